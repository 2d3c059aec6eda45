"""Policies scored through the engine's paged ops (``vllm_evict.paged_ops.PagedScoreOps``) keep exactly
the tokens, and reach the same state, as with the dense reference ``ScoreOps``, for every policy spec,
on the PyTorch and Triton backends; a spec whose heavy arithmetic the ops cover never gathers K or V.

This is the path the eviction step (``vllm_evict.evict_step.group_inputs``) sets up: a batch of rows of
different lengths over shuffled pages of one layer's cache, logical positions in an int32 paged buffer
(shuffled, with gaps), windows in ring order with empty entries, K and V deferred gathers.
"""

from __future__ import annotations

import pytest
import torch

from vllm_evict import paged
from vllm_evict.config import EvictionConfig
from vllm_evict.paged_ops import DISPATCHED, PagedScoreOps
from vllm_evict.policies.base import Deferred, EvictionInputs, Phase, Policy
from vllm_evict.policies.score_ops import DENSE

from kernel_cases import block_table, make_kv, pages_needed, positions_buffer
from tests.policies.helpers import SPECS, build, init_rows, options_for

BS = 16
D = 64
HEADS = 2
LENGTHS = [75, 40, 17]  # four full pages and a partial one; shorter rows are padding up to 75
BUDGETS = [40, 20, 12]
WINDOW = 24  # query entries handed over at most (the ring's width for these tests)
LIVE = [24, 13, 5]  # live entries per row; the rest of the window is empty (-1)

# Specs that read dense K or V themselves (key norms; CAOTE's per-query-head mode): the gather must run.
READS_DENSE_KV = [("knorm", {}), ("caote+snapkv", {"caote_mode": "head"}), ("fastcaote+tova", {"caote_mode": "head"})]
NO_DENSE_KV = [spec for spec in SPECS if spec != "knorm"]


def paged_case(device: torch.device, group: int, layout: str, seed: int) -> dict:
    num_pages = pages_needed(LENGTHS, BS) + 3
    k, v = make_kv(num_pages, HEADS, BS, D, torch.float32, layout, device, seed=seed)
    table = block_table(LENGTHS, BS, num_pages, device, seed=seed, dtype=torch.int64)
    positions = positions_buffer(num_pages, HEADS, BS, table, LENGTHS, device, seed=seed)  # int32, < 2n
    gen = torch.Generator().manual_seed(seed + 11)
    queries = torch.randn(len(LENGTHS), HEADS * group, WINDOW, D, generator=gen)
    qpos = torch.full((len(LENGTHS), WINDOW), -1, dtype=torch.int64)
    for r, (n, live) in enumerate(zip(LENGTHS, LIVE)):
        qpos[r, :live] = torch.arange(2 * n - live, 2 * n)  # the newest queries (seq_len = 2n)
        qpos[r] = qpos[r].roll(5 * r)  # a ring buffer
    o_proj = torch.randn(96, HEADS * group * D, generator=gen) * 0.05
    return dict(k=k, v=v, table=table, positions=positions, queries=queries.to(device), qpos=qpos.to(device),
                o_proj=o_proj.to(device), lengths=torch.tensor(LENGTHS, device=device))


def inputs(policy: Policy, case: dict, phase: Phase, ops, keys, values) -> EvictionInputs:
    width = max(LENGTHS)
    dense_k = paged.gather_tokens(case["k"], case["table"], width)
    dense_v = paged.gather_tokens(case["v"], case["table"], width)
    lengths = case["lengths"]
    num_new = torch.ones_like(lengths) if phase is Phase.DECODE else torch.tensor([24, 5, 17], device=lengths.device)
    queries, qpos = case["queries"], case["qpos"]
    if policy.query_window is None:  # H2O: this step's queries only
        keep = qpos >= (2 * lengths - num_new).view(-1, 1)
        qpos = torch.where(keep, qpos, torch.full_like(qpos, -1))
    budget = torch.tensor(BUDGETS, device=lengths.device)
    positions = paged.gather_tokens(case["positions"], case["table"], width)
    return EvictionInputs(keys=keys, values=values, positions=positions, lengths=lengths, queries=queries,
                          query_positions=qpos, scale=D ** -0.5, seq_len=2 * lengths, num_new=num_new, phase=phase,
                          state=init_rows(policy, dense_k, dense_v, case["o_proj"]), layer=3,
                          seed=torch.tensor([5, 6, 7], device=lengths.device), head_offset=2,
                          o_proj=case["o_proj"] if policy.needs_o_proj else None, budget=budget,
                          budget_max=max(BUDGETS), max_seq_len=2 * int(lengths.max()), ops=ops)


def run(spec: str, options: dict, device, backend: str, group: int, layout: str, phase: Phase = Phase.PROMPT_END):
    """Both paths on one case; returns which of K and V the paged path gathered."""
    policy = EvictionConfig.from_spec(spec, budget=min(BUDGETS), **{**options_for(spec), **options}).build_policy()
    case = paged_case(device, group, layout, seed=group + len(spec))
    width = max(LENGTHS)
    want = policy.step(inputs(policy, case, phase, DENSE, paged.gather_tokens(case["k"], case["table"], width),
                              paged.gather_tokens(case["v"], case["table"], width)))

    gathered: list[str] = []

    def deferred(name: str) -> Deferred:
        def load() -> torch.Tensor:
            gathered.append(name)
            return paged.gather_tokens(case[name[0]], case["table"], width)
        return Deferred(load)

    ops = PagedScoreOps(k_cache=case["k"], v_cache=case["v"], positions=case["positions"], block_table=case["table"],
                        lengths=case["lengths"], width=width, backend=backend)
    got = policy.step(inputs(policy, case, phase, ops, deferred("keys"), deferred("values")))
    assert got.keep is not None and want.keep is not None
    assert got.keep.shape == (len(LENGTHS), HEADS, max(BUDGETS))
    for r, b in enumerate(BUDGETS):
        assert torch.equal(got.keep[r, :, :b], want.keep[r, :, :b]), f"{spec} {options} {backend}: row {r} kept sets"
        assert (got.keep[r, :, b:] == width).all()
    for name in policy.state_names:
        for r, n in enumerate(LENGTHS):
            torch.testing.assert_close(got.state[name][r, :, :n], want.state[name][r, :, :n], rtol=1e-4, atol=1e-6)
    return gathered


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", NO_DENSE_KV)
def test_policy_through_paged_ops(device, backend, spec):
    group, layout = (3, "cpu") if len(spec) % 2 else (1, "nhd")  # vary GQA and layout across policies
    gathered = run(spec, {}, device, backend, group, layout)
    assert gathered == [], f"{spec} gathered {gathered} although the ops cover its arithmetic"


@pytest.mark.parametrize("spec", ["h2o", "ahakv", "caote+h2o", "criticalkv+ahakv", "random"])
def test_decode_phase_through_paged_ops(device, spec):
    assert run(spec, {}, device, "triton", 7, "hnd", phase=Phase.DECODE) == []


@pytest.mark.parametrize("spec,options", READS_DENSE_KV)
def test_policies_reading_dense_kv_still_agree(device, spec, options):
    gathered = run(spec, options, device, "triton", 3, "cpu")
    assert gathered, f"{spec} {options} reads dense K/V, so the deferred gather must have run"


def test_criticalkv_nu_through_the_dispatch(device):
    """The engine computes nu of a step's tokens through the ops dispatch (Triton on a GPU)."""
    policy = build("criticalkv+snapkv", 20)
    case = paged_case(device, 3, "cpu", seed=4)
    values = paged.gather_tokens(case["v"], case["table"], max(LENGTHS))[0]  # [H, T, d]: one row's tokens
    got = policy.init_state(values, values, case["o_proj"], DISPATCHED)
    want = policy.init_state(values, values, case["o_proj"], DENSE)
    assert set(got) == set(want) == {"nu"}
    torch.testing.assert_close(got["nu"], want["nu"], rtol=1e-4, atol=1e-5)
