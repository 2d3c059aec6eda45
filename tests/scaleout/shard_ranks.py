"""One rank of test_kv_shard.py: every policy spec on this rank's share of a paged layer, its group sums
completed over a real gloo process group, against the same policy on the whole layer.

    torch.multiprocessing.spawn(rank_main, args=(world, port, out_dir), nprocs=world)

Each rank builds the same seeded case (all KV heads, all query heads, the whole output projection),
scores it whole as TP 1 would (``PagedScoreOps`` without a shard), then scores its own slice as vLLM
shards it: its KV heads (a view of the paged cache), its query heads, its columns of ``o_proj``, with
``kv_replicas`` and a ``KVShard`` whose all-reduce is ``torch.distributed.all_reduce`` over the group.
It writes what differs, and how many all-reduces it issued, to ``out_dir/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
from torch import Tensor

# (total KV heads, query heads per KV head) over 4 ranks: 2 copies of 2 heads, 4 copies of 1 head,
# and 4 heads over 4 ranks (no copies: no all-reduce at all).
LAYOUTS = {"kv2-g4": (2, 4), "kv1-g4": (1, 4), "kv4-g2": (4, 2)}
BS, D, HIDDEN, WINDOW = 16, 32, 48, 24
LENGTHS = [75, 40, 17]
BUDGETS = [40, 20, 12]
LIVE = [24, 13, 5]


def case(kv_heads: int, group: int, seed: int) -> dict:
    from tests.kernels.kernel_cases import block_table, make_kv, pages_needed, positions_buffer

    num_pages = pages_needed(LENGTHS, BS) + 2
    k, v = make_kv(num_pages, kv_heads, BS, D, torch.float32, "cpu", torch.device("cpu"), seed=seed)
    table = block_table(LENGTHS, BS, num_pages, torch.device("cpu"), seed=seed, dtype=torch.int64)
    positions = positions_buffer(num_pages, kv_heads, BS, table, LENGTHS, torch.device("cpu"), seed=seed)
    gen = torch.Generator().manual_seed(seed + 11)
    queries = torch.randn(len(LENGTHS), kv_heads * group, WINDOW, D, generator=gen) * 2.0  # peaked attention
    qpos = torch.full((len(LENGTHS), WINDOW), -1, dtype=torch.int64)
    for r, (n, live) in enumerate(zip(LENGTHS, LIVE)):
        qpos[r, :live] = torch.arange(2 * n - live, 2 * n)
        qpos[r] = qpos[r].roll(5 * r)
    o_proj = torch.randn(HIDDEN, kv_heads * group * D, generator=gen) * 0.05
    return dict(k=k, v=v, table=table, positions=positions, queries=queries, qpos=qpos, o_proj=o_proj,
                lengths=torch.tensor(LENGTHS))


def run_policy(policy, c: dict, phase, shard, heads: slice, query_heads: slice) -> object:
    """``policy.step`` on KV heads ``heads`` and query heads ``query_heads`` of case ``c``."""
    from vllm_evict import paged
    from vllm_evict.paged_ops import DispatchedScoreOps, PagedScoreOps
    from vllm_evict.policies.base import EvictionInputs, Phase

    width = max(LENGTHS)
    k, v, pos = c["k"][:, heads], c["v"][:, heads], c["positions"][:, heads]
    dense_k, dense_v = paged.gather_tokens(k, c["table"], width), paged.gather_tokens(v, c["table"], width)
    o_proj = c["o_proj"][:, query_heads.start * D:query_heads.stop * D]
    lengths = c["lengths"]
    num_new = torch.ones_like(lengths) if phase is Phase.DECODE else torch.tensor([24, 5, 17])
    qpos = c["qpos"]
    if policy.query_window is None:  # H2O: this step's queries only
        qpos = torch.where(qpos >= (2 * lengths - num_new).view(-1, 1), qpos, torch.full_like(qpos, -1))
    # Per-token state as the engine's record phase computes it: through the (sharded) dispatch.
    rows, h, n, d = dense_k.shape
    flat = lambda x: x.permute(1, 0, 2, 3).reshape(h, rows * n, d)  # noqa: E731
    computed = policy.init_state(flat(dense_k), flat(dense_v), o_proj, DispatchedScoreOps(shard))
    state = {name: value.reshape(h, rows, n).permute(1, 0, 2) for name, value in computed.items()}
    for name in policy.state_names:
        state.setdefault(name, torch.zeros(rows, h, n))
    ops = PagedScoreOps(k_cache=k, v_cache=v, positions=pos, block_table=c["table"], lengths=lengths, width=width,
                        backend="torch", shard=shard)
    inp = EvictionInputs(
        keys=dense_k, values=dense_v, positions=paged.gather_tokens(pos, c["table"], width), lengths=lengths,
        queries=c["queries"][:, query_heads], query_positions=qpos, scale=D ** -0.5, seq_len=2 * lengths,
        num_new=num_new, phase=phase, state=state, layer=3, seed=torch.tensor([5, 6, 7]),
        head_offset=heads.start, o_proj=o_proj if policy.needs_o_proj else None,
        budget=torch.tensor(BUDGETS), budget_max=max(BUDGETS), max_seq_len=2 * int(lengths.max()),
        kv_replicas=shard.kv_replicas if shard is not None else 1, ops=ops)
    return policy.step(inp)


def differences(got, want, local: slice, name: str) -> list[str]:
    """Where this rank's result differs from the whole layer's on its heads."""
    problems = []
    for r, b in enumerate(BUDGETS):
        if not torch.equal(got.keep[r, :, :b], want.keep[r, local, :b]):
            problems.append(f"{name}: row {r} keeps other slots")
    for key, value in got.state.items():
        for r, n in enumerate(LENGTHS):
            if not torch.allclose(value[r, :, :n], want.state[key][r, local, :n], rtol=1e-4, atol=1e-6):
                problems.append(f"{name}: row {r} state {key} differs")
    return problems


def specs() -> list[tuple[str, dict, object]]:
    from tests.policies.helpers import SPECS
    from vllm_evict.policies.base import Phase

    cases = [(spec, {}, Phase.PROMPT_END) for spec in SPECS]
    cases += [("caote+snapkv", {"caote_mode": "head"}, Phase.PROMPT_END),
              ("fastcaote+tova", {"caote_mode": "head"}, Phase.PROMPT_END)]
    cases += [(spec, {}, Phase.DECODE) for spec in ("h2o", "ahakv", "criticalkv+h2o", "caote+ahakv")]
    return cases


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.policies.helpers import options_for
    from vllm_evict.config import EvictionConfig
    from vllm_evict.kv_shard import KVShard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    calls = [0]

    def all_reduce(t: Tensor) -> Tensor:
        calls[0] += 1
        dist.all_reduce(t)
        return t

    report: dict[str, dict] = {}
    try:
        for layout, (kv_heads, group) in LAYOUTS.items():
            calls[0] = 0
            shard = KVShard.of_rank(rank, world, kv_heads, all_reduce)
            heads = slice(shard.head_offset, shard.head_offset + shard.local_kv_heads)
            local_q = shard.local_kv_heads * group // shard.kv_replicas
            first_q = shard.head_offset * group + shard.replica * local_q
            problems: list[str] = []
            layer_wide = 0  # all-reduces of methods that rank by the whole layer (TOVA's default)
            for index, (spec, options, phase) in enumerate(specs()):
                before = calls[0]
                policy = EvictionConfig.from_spec(spec, budget=min(BUDGETS),
                                                  **{**options_for(spec), **options}).build_policy()
                c = case(kv_heads, group, seed=index)
                want = run_policy(policy, c, phase, None, slice(0, kv_heads), slice(0, kv_heads * group))
                got = run_policy(policy, c, phase, shard, heads, slice(first_q, first_q + local_q))
                problems += differences(got, want, heads, f"{spec} {options} {phase.value}")
                if getattr(getattr(policy, "base", policy), "heads", None) == "layer":
                    layer_wide += calls[0] - before
            report[layout] = {"problems": problems, "all_reduces": calls[0] - layer_wide, "layer_wide": layer_wide,
                              "replicas": shard.kv_replicas,
                              "head_offset": shard.head_offset}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":  # pragma: no cover - run through test_kv_shard.py
    raise SystemExit(os.EX_USAGE)
