"""Policies scored through the engine's paged kernels (engine/paged_kernels.py) keep exactly the tokens
they keep with the dense reference, on every backend, and never gather K/V they do not read.

This is the path the model runner takes: ``EvictionInputs.kernels`` is a ``PagedScoreKernels`` over
the request's pages, and ``keys`` / ``values`` are deferred gathers.
"""

from __future__ import annotations

import pytest
import torch

from vllm_evict import paged
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.paged_kernels import PagedScoreKernels
from vllm_evict.policies.base import Deferred, EvictionInputs, Phase
from vllm_evict.policies.criticalkv import projected_value_l1
from vllm_evict.policies.kernels import DENSE

from kernel_cases import block_table, make_kv, positions_buffer

BS = 16
D = 64
HEADS = 2
N = 75  # candidates: four full pages and a partial one
BUDGET = 40

# Policies whose arithmetic is all in the kernels: the engine must not gather K or V for them.
NO_DENSE_KV = ["snapkv", "h2o", "tova", "nacl", "ahakv", "keydiff", "random", "streamingllm", "caote+snapkv",
               "fastcaote+h2o", "caote+tova", "criticalkv+snapkv", "caote+ahakv"]
# Policies that also read dense K or V (key norms; CAOTE's per-query-head mode).
READS_DENSE_KV = [("knorm", {}), ("caote+snapkv", {"caote_mode": "head"}), ("fastcaote+tova", {"caote_mode": "head"})]


def _paged_case(device, group: int, layout: str, seed: int):
    nb = -(-N // BS) + 4
    k, v = make_kv(nb, HEADS, BS, D, torch.float32, layout, device, seed=seed)
    table = block_table([N], BS, nb, device, seed=seed, dtype=torch.int64)
    ids = table[0]
    pos_buffer = positions_buffer(nb, HEADS, BS, table, [N], device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 11)
    w = 24
    queries = torch.randn(HEADS * group, w, D, generator=gen).to(device)
    query_positions = torch.arange(2 * N - w, 2 * N, device=device)
    o_proj = (torch.randn(96, HEADS * group * D, generator=gen) * 0.05).to(device)
    return k, v, pos_buffer, ids, queries, query_positions, o_proj, nb


def _inputs(policy, case, kernels, keys, values, phase: Phase) -> EvictionInputs:
    k, v, pos_buffer, ids, queries, query_positions, o_proj, _ = case
    dense_k, dense_v = paged.gather_tokens(k, ids, N), paged.gather_tokens(v, ids, N)
    state = policy.init_state(dense_k, dense_v, o_proj)  # dense reference state for every candidate
    window = policy.query_window
    if window is not None:
        queries, query_positions = queries[:, queries.shape[1] - window:], query_positions[query_positions.shape[0] - window:]
    return EvictionInputs(keys=keys, values=values, positions=paged.gather_tokens(pos_buffer, ids, N),
                          queries=queries, query_positions=query_positions, scale=D ** -0.5, seq_len=2 * N,
                          num_new=queries.shape[1], phase=phase, state=state, layer=3, seed=5,
                          o_proj=o_proj if policy.needs_o_proj else None, kernels=kernels)


def _run(spec: str, options: dict, device, backend: str, group: int, layout: str, must_not_gather: bool,
         phase: Phase = Phase.PROMPT_END):
    policy = EvictionConfig.from_spec(spec, budget=BUDGET, **options).build_policy()
    case = _paged_case(device, group, layout, seed=group)
    k, v, pos_buffer, ids, *_ = case
    dense = _inputs(policy, case, kernels=DENSE, keys=paged.gather_tokens(k, ids, N),
                    values=paged.gather_tokens(v, ids, N), phase=phase)
    want = policy.step(dense, BUDGET)

    gathered: list[str] = []

    def deferred(name, cache):
        def load():
            gathered.append(name)
            return paged.gather_tokens(cache, ids, N)
        return Deferred(load)

    kernels = PagedScoreKernels(k_cache=k, v_cache=v, positions=pos_buffer, block_ids=ids, length=N,
                                backend=backend)
    got = policy.step(_inputs(policy, case, kernels, deferred("keys", k), deferred("values", v), phase), BUDGET)
    assert got.keep is not None and want.keep is not None
    assert got.keep.shape == (HEADS, BUDGET)
    assert torch.equal(got.keep, want.keep), f"{spec} {options} on {backend}: kept sets differ"
    for name in policy.state_names:
        torch.testing.assert_close(got.state[name], want.state[name], rtol=1e-4, atol=1e-6)
    if must_not_gather:
        assert gathered == [], f"{spec} gathered {gathered} although its kernels cover its arithmetic"
    return gathered


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", NO_DENSE_KV)
def test_policy_through_paged_kernels(device, backend, spec):
    group, layout = (3, "cpu") if len(spec) % 2 else (1, "nhd")  # vary GQA and layout across policies
    _run(spec, {}, device, backend, group, layout, must_not_gather=True)


@pytest.mark.parametrize("spec", ["h2o", "ahakv", "caote+h2o"])
def test_decode_phase_through_paged_kernels(device, spec):
    _run(spec, {}, device, "triton", 7, "hnd", must_not_gather=True, phase=Phase.DECODE)


@pytest.mark.parametrize("spec,options", READS_DENSE_KV)
def test_policies_reading_dense_kv_still_agree(device, spec, options):
    gathered = _run(spec, options, device, "triton", 3, "cpu", must_not_gather=False)
    assert gathered, f"{spec} {options} reads dense K/V, so the deferred gather must have run"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_criticalkv_nu_written_into_the_paged_state(device, backend):
    """The engine computes nu of a step's new slots from the values already in the cache."""
    case = _paged_case(device, 3, "cpu", seed=4)
    k, v, pos_buffer, ids, _, _, o_proj, nb = case
    nu_buffer = torch.zeros(nb, HEADS, BS, dtype=torch.float32, device=device)
    start = 50  # this step's tokens are slots 50..74
    kernels = PagedScoreKernels(k_cache=k, v_cache=v, positions=pos_buffer, block_ids=ids, length=N,
                                new_start=start, state_buffer={"nu": nu_buffer}.__getitem__, backend=backend)
    dense_v = paged.gather_tokens(v, ids, N)
    got = kernels.projected_value_norms(dense_v[:, start:], o_proj, state_name="nu")
    want = projected_value_l1(dense_v[:, start:], o_proj)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    stored = paged.gather_tokens(nu_buffer, ids, N)
    torch.testing.assert_close(stored[:, start:], want, rtol=1e-4, atol=1e-5)
    assert stored[:, :start].abs().sum() == 0, "slots before the new tokens must be left alone"
