"""Benchmark of the eviction kernels at Llama-3.1-8B shapes, written to docs/benchmarks/kernels.md.

    python benchmarks/kernels.py                      # measure on the visible GPU, write the report
    python benchmarks/kernels.py --dry-run            # write the report skeleton, every cell unmeasured

Shapes: 32 layers, 8 KV heads, 32 query heads, head_dim 128, hidden 4096, bf16, block size 16;
contexts 4k/32k/128k, budgets 1k/2k/4k, a 32-query observation window, 2k prefill chunks.

For every kernel and backend (Triton, CUDA where one exists, the PyTorch reference for scale): median
time, bytes read + written (the minimum traffic the operation needs), achieved bandwidth and its
fraction of the peak, where the peak is measured in the same run by a device-to-device copy.
Then the eviction cost of one layer at each (context, budget) - scoring the context, top-k, and
compacting to the budget - next to the attention time of a 2k prefill chunk over that context
(torch SDPA), for SnapKV, KeyDiff, CAOTE+SnapKV and CriticalKV+SnapKV with the fastest backends.
The report ends with the preference table (``vllm_evict.ops.set_preference``) the timings imply.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS, H_KV, H_Q, D, HIDDEN = 32, 8, 32, 128, 4096
BLOCK_SIZE, WINDOW, CHUNK = 16, 32, 2048
CONTEXTS = (4096, 32768, 131072)
BUDGETS = (1024, 2048, 4096)
UNMEASURED = "unmeasured (no GPU in this task)"
COMMAND = "python benchmarks/kernels.py --out docs/benchmarks/kernels.md"

KERNEL_OPS = ("window_attention_mass", "keydiff_scores", "caote_scores", "criticalkv_value_norms",
              "compact_tokens")
POLICIES = {
    "snapkv": ("window_attention_mass",),
    "keydiff": ("keydiff_scores",),
    "caote+snapkv": ("window_attention_mass", "caote_scores"),
    "criticalkv+snapkv": ("window_attention_mass", "criticalkv_value_norms"),
}


@dataclass
class Row:
    op: str
    backend: str
    context: int
    budget: int | None
    ms: float | None
    bytes: int
    peak: float | None

    def cells(self) -> list[str]:
        if self.ms is None:
            return [self.op, self.backend, _k(self.context), _k(self.budget), UNMEASURED, f"{self.bytes / 2**20:.1f}",
                    UNMEASURED, UNMEASURED]
        gbs = self.bytes / (self.ms * 1e-3) / 1e9
        return [self.op, self.backend, _k(self.context), _k(self.budget), f"{self.ms * 1e3:.1f}",
                f"{self.bytes / 2**20:.1f}", f"{gbs:.0f}", f"{100 * gbs / self.peak:.0f}%"]


def _k(n: int | None) -> str:
    return "-" if n is None else f"{n // 1024}k"


def op_bytes(op: str, context: int, budget: int, elem: int = 2) -> int:
    """Minimum traffic of one layer's call (read + write), in bytes."""
    kv_head = context * D * elem  # one KV head's keys (or values)
    if op == "window_attention_mass":  # keys, both passes; queries; fp32 mass out
        return H_KV * 2 * kv_head + WINDOW * H_Q * D * elem + H_KV * context * 4
    if op == "keydiff_scores":  # keys twice (anchor, then scores); fp32 out
        return H_KV * 2 * kv_head + H_KV * context * 4
    if op == "caote_scores":  # values + alpha twice; fp32 out
        return H_KV * (2 * kv_head + 2 * context * 4 + context * 4)
    if op == "criticalkv_value_norms":  # the chunk's values, o_proj, fp32 nu out
        return H_KV * CHUNK * D * elem + HIDDEN * H_Q * D * elem + H_KV * CHUNK * 4
    if op == "compact_tokens":  # budget slots of K and V read and written (upper bound: all move)
        return 2 * 2 * H_KV * budget * D * elem
    raise KeyError(op)


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---- measurement ------------------------------------------------------------------------------------
def _time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    if torch.cuda.is_available():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def peak_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (read + write counted), this run's bandwidth ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / (ms * 1e-3) / 1e9


class Case:
    """One layer's paged cache with one request of ``context`` tokens (shuffled pages, NHD layout)."""

    def __init__(self, context: int, device: torch.device, dtype=torch.bfloat16, seed: int = 0):
        torch.manual_seed(seed)
        pages = -(-(context + CHUNK) // BLOCK_SIZE)
        raw = torch.randn(pages, BLOCK_SIZE, H_KV, 2 * D, device=device, dtype=dtype)
        self.k, self.v = raw.transpose(1, 2).split(D, dim=-1)  # FLASH_ATTN's NHD views
        self.table = torch.randperm(pages, device=device).to(torch.int32).view(1, -1)
        self.context = context
        self.lengths = torch.tensor([context], device=device)
        self.queries = torch.randn(WINDOW, H_Q, D, device=device, dtype=dtype)
        self.qsl = torch.tensor([0, WINDOW], device=device)
        self.qpos = torch.arange(context - WINDOW, context, device=device)
        self.alpha = torch.softmax(torch.randn(1, H_KV, context, device=device), dim=-1)
        self.o_proj = torch.randn(HIDDEN, H_Q * D, device=device, dtype=dtype) * D ** -0.5
        self.nu = torch.zeros(pages, H_KV, BLOCK_SIZE, device=device)
        self.device = device

    def keep(self, budget: int) -> torch.Tensor:
        scores = torch.rand(1, H_KV, self.context, device=self.device)
        return torch.sort(torch.topk(scores, budget, dim=-1).indices, dim=-1).values

    def call(self, op: str, backend: str, budget: int):
        from vllm_evict import ops

        if op == "window_attention_mass":
            return lambda: ops.window_attention_mass(self.k, self.table, self.lengths, self.queries, self.qsl,
                                                     self.qpos, D ** -0.5, max_len=self.context, backend=backend)
        if op == "keydiff_scores":
            return lambda: ops.keydiff_scores(self.k, self.table, self.lengths, max_len=self.context, backend=backend)
        if op == "caote_scores":
            return lambda: ops.caote_scores(self.v, self.table, self.lengths, self.alpha, backend=backend)
        if op == "criticalkv_value_norms":
            starts = torch.tensor([max(0, self.context - CHUNK)], device=self.device)
            return lambda: ops.criticalkv_value_norms(self.v, self.table, starts, self.lengths, self.o_proj, self.nu,
                                                      backend=backend)
        if op == "compact_tokens":
            keep = self.keep(budget)
            # in place and idempotent enough for timing: the same keep set moves data every call
            return lambda: ops.compact_tokens([self.k, self.v], self.table, keep, backend=backend)
        raise KeyError(op)

    def engine_step(self, spec: str, budget: int):
        """What the model runner does for one layer of one request: ``policy.step`` with the paged score
        kernels and deferred K/V gathers (engine/runner.py), then compaction of K, V and positions."""
        from functools import partial

        from vllm_evict import ops, paged
        from vllm_evict.config import EvictionConfig
        from vllm_evict.engine.paged_kernels import PagedScoreKernels
        from vllm_evict.policies.base import Deferred, EvictionInputs, Phase

        policy = EvictionConfig.from_spec(spec, budget=budget).build_policy()
        ids, n = self.table[0].long(), self.context
        positions = torch.zeros(self.nu.shape, dtype=torch.int64, device=self.device)
        paged.write_tokens(positions, ids, 0, torch.arange(n, device=self.device).expand(H_KV, n))
        start = max(0, n - CHUNK)  # this chunk's tokens are the last CHUNK slots
        buffers = {name: torch.zeros(self.nu.shape, device=self.device) for name in policy.state_names}
        kernels = PagedScoreKernels(k_cache=self.k, v_cache=self.v, positions=positions, block_ids=ids, length=n,
                                    new_start=start, state_buffer=buffers.__getitem__)
        # The runner has the chunk's K/V from the layer's inputs; here they are taken once, untimed.
        new_keys = paged.gather_tokens(self.k, ids, n)[:, start:]
        new_values = paged.gather_tokens(self.v, ids, n)[:, start:]
        queries = self.queries.transpose(0, 1)  # [H_q, w, d]
        window = policy.query_window

        def step() -> None:
            for name, values in policy.init_state(new_keys, new_values, self.o_proj, kernels).items():
                ops.write_tokens(buffers[name], ids, start, values)
            inp = EvictionInputs(
                keys=Deferred(partial(ops.gather_tokens, self.k, ids, n)),
                values=Deferred(partial(ops.gather_tokens, self.v, ids, n)),
                positions=ops.gather_tokens(positions, ids, n),
                queries=queries if window is None else queries[:, queries.shape[1] - window:],
                query_positions=self.qpos if window is None else self.qpos[self.qpos.shape[0] - window:],
                scale=D ** -0.5, seq_len=n, num_new=n - start, phase=Phase.PROMPT_END,
                state={name: ops.gather_tokens(buf, ids, n) for name, buf in buffers.items()},
                o_proj=self.o_proj, kernels=kernels)
            result = policy.step(inp, budget)
            ops.compact_tokens([self.k, self.v, positions, *buffers.values()], ids, result.keep)

        return step

    def topk(self, budget: int):
        scores = torch.rand(1, H_KV, self.context, device=self.device)
        from vllm_evict.policies.base import topk_keep

        return lambda: topk_keep(scores, budget)

    def attention(self):
        """SDPA of one 2k prefill chunk (32 query heads) over ``context`` keys (GQA expanded)."""
        q = torch.randn(1, H_Q, CHUNK, D, device=self.device, dtype=torch.bfloat16)
        k = torch.randn(1, H_Q, self.context, D, device=self.device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda: sdpa(q, k, v)


def backends_for(op: str) -> list[str]:
    from vllm_evict import ops

    out = ["triton"]
    if op in ops.CUDA_OPS:
        out.insert(0, "cuda")
    return out


def measure(args) -> tuple[str, float, list[Row], list[list[str]], dict[str, str]]:
    from vllm_evict import csrc

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = peak_bandwidth(device)
    rows: list[Row] = []
    best: dict[tuple[str, int, int], tuple[float, str]] = {}
    wins: dict[str, dict[str, float]] = {op: {} for op in KERNEL_OPS}
    cost_rows: list[list[str]] = []
    cuda_ok = csrc.load_extension() is not None
    if not cuda_ok:
        print(f"CUDA extension unavailable ({csrc.load_error()}); timing Triton only", file=sys.stderr)
    for context in args.contexts:
        case = Case(context, device)
        attention_ms = _time_ms(case.attention())
        topk_ms = {b: _time_ms(case.topk(b)) for b in args.budgets if b < context}
        for op in KERNEL_OPS:
            budgets = [b for b in args.budgets if b < context] if op == "compact_tokens" else [None]
            for budget in budgets:
                for backend in backends_for(op):
                    if backend == "cuda" and not cuda_ok:
                        continue
                    ms = _time_ms(case.call(op, backend, budget or 0))
                    rows.append(Row(op, backend, context, budget, ms, op_bytes(op, context, budget or 0), peak))
                    key = (op, context, budget or 0)
                    if key not in best or ms < best[key][0]:
                        best[key] = (ms, backend)
                    wins[op][backend] = wins[op].get(backend, 0.0) + ms
        for budget in [b for b in args.budgets if b < context]:
            compact_ms = best[("compact_tokens", context, budget)][0]
            for policy, parts in POLICIES.items():
                ms = sum(best[(p, context, 0)][0] for p in parts) + topk_ms[budget] + compact_ms
                engine_ms = _time_ms(case.engine_step(policy, budget), reps=10)
                cost_rows.append([policy, _k(context), _k(budget), f"{ms * 1e3:.0f}", f"{engine_ms * 1e3:.0f}",
                                  f"{attention_ms * 1e3:.0f}", f"{100 * ms / attention_ms:.1f}%",
                                  f"{100 * engine_ms / attention_ms:.1f}%", f"{LAYERS * engine_ms:.2f}"])
        del case
        torch.cuda.empty_cache()
    preference = {op: min(t, key=t.get) for op, t in wins.items() if t}
    return name, peak, rows, cost_rows, preference


def skeleton(args) -> tuple[list[Row], list[list[str]]]:
    rows = []
    for context in args.contexts:
        for op in KERNEL_OPS:
            budgets = [b for b in args.budgets if b < context] if op == "compact_tokens" else [None]
            for budget in budgets:
                for backend in backends_for(op):
                    rows.append(Row(op, backend, context, budget, None, op_bytes(op, context, budget or 0), None))
    cost_rows = [[policy, _k(c), _k(b), *[UNMEASURED] * 6]
                 for c in args.contexts for b in args.budgets if b < c for policy in POLICIES]
    return rows, cost_rows


def report(args, gpu: str, peak: float | None, rows: list[Row], cost_rows: list[list[str]],
           preference: dict[str, str] | None) -> str:
    import triton

    peak_s = f"{peak:.0f} GB/s (device-to-device copy of 1 GiB, read + write)" if peak else UNMEASURED
    lines = [
        "# Eviction kernels: benchmark",
        "",
        f"Produced by `{COMMAND}` (benchmarks/kernels.py). Never edit the numbers by hand.",
        "",
        *([f"This is the skeleton written by `--dry-run`: nothing has been measured yet (no GPU in this task). "
           f"Every time, bandwidth and ratio is a target to fill by running `{COMMAND}` on a machine with a "
           "CUDA GPU; only the byte counts are computed (from the shapes), not measured.", ""] if peak is None else []),
        f"- GPU: {gpu}",
        f"- torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}",
        f"- peak bandwidth: {peak_s}",
        f"- shapes: Llama-3.1-8B, {LAYERS} layers, {H_KV} KV heads, {H_Q} query heads, head_dim {D}, hidden {HIDDEN}, "
        f"bf16, block size {BLOCK_SIZE}, NHD (FLASH_ATTN) views, shuffled pages, one request; "
        f"observation window {WINDOW} queries; prefill chunk {CHUNK}.",
        "- bytes: the minimum traffic of the operation for one layer (read + written); "
        "`compact_tokens` counts K and V as if every kept slot moved.",
        "",
        "## Per-kernel time (one layer)",
        "",
        _table(["op", "backend", "context", "budget", "time (us)", "MiB moved", "GB/s", "of peak"],
               [r.cells() for r in rows]),
        "",
        "## Eviction cost per 2k prefill chunk, next to that chunk's attention",
        "",
        "One layer, against torch SDPA of a 2k-query chunk over the context's keys. *ops*: the policy's "
        "score op(s) on their fastest backend, top-k and compaction to the budget, timed apart and added up. "
        "*engine step*: what the model runner runs, `policy.step` with the paged score kernels "
        "(vllm_evict/engine/paged_kernels.py, default backend choice) plus compaction of K, V and positions, "
        f"timed as one. The last column is the engine step summed over {LAYERS} layers.",
        "",
        _table(["policy", "context", "budget", "ops (us)", "engine step (us)", "chunk attention (us)",
                "ops / attention", "engine step / attention", f"engine step x {LAYERS} layers (ms)"], cost_rows),
        "",
        "## Backend preference implied by these timings",
        "",
    ]
    if preference:
        lines.append(_table(["op", "faster backend"], [[op, b] for op, b in preference.items()]))
        spec = ",".join(f"{op}={b}" for op, b in preference.items())
        lines += ["", f"Apply with `VLLM_EVICT_KERNELS=\"{spec}\"` or `vllm_evict.ops.set_preference`."]
    else:
        lines.append(f"{UNMEASURED}. Defaults until measured: CUDA for compact_tokens and window_attention_mass "
                     "(when the extension builds), Triton for the others.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "kernels.md")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(CONTEXTS))
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=list(BUDGETS))
    parser.add_argument("--dry-run", action="store_true",
                        help="write the report skeleton with every measurement marked unmeasured (no GPU needed)")
    args = parser.parse_args(argv)
    if args.dry_run:
        rows, cost_rows = skeleton(args)
        text = report(args, UNMEASURED, None, rows, cost_rows, None)
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernels.py measures GPU kernels and needs a CUDA device; none is visible here "
                  f"(torch {torch.__version__}). Run it on a GPU machine: {COMMAND}\n"
                  "(--dry-run writes the report skeleton without measuring.)", file=sys.stderr)
            return 2
        os.environ.pop("TRITON_INTERPRET", None)
        gpu, peak, rows, cost_rows, preference = measure(args)
        text = report(args, gpu, peak, rows, cost_rows, preference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
