"""Contract properties every registered policy (and every meta score over snapkv and h2o) must satisfy,
over random shapes, GQA group sizes, phases and budgets (see ``vllm_evict/policies/base.py``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_evict.config import EvictionConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES
from vllm_evict.policies.base import EvictionInputs, Phase, Policy

from .helpers import make_inputs, window_for, with_initial_state

# Smaller protected windows than the paper defaults, so that budgets below n = 80 are possible.
SMALL_OPTIONS: dict[str, dict] = {"snapkv": {"window": 4}, "ahakv": {"recent": 4}}
META_BASES = ("snapkv", "h2o")

SPECS = list(BASE_POLICIES) + [f"{meta}+{base}" for meta in META_POLICIES for base in META_BASES]

# Deterministic, slot-order-free policies: permuting the slots must permute the scores.
EQUIVARIANT = ("snapkv", "h2o", "tova", "streamingllm", "knorm", "keydiff")

SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def options_for(spec: str) -> dict:
    return dict(SMALL_OPTIONS.get(spec.split("+")[-1], {}))


@functools.lru_cache(maxsize=None)
def valid_budgets(spec: str, n: int) -> tuple[int, ...]:
    """Budgets up to n + 3 that ``from_spec`` accepts (the protected tokens must fit)."""
    out = []
    for budget in range(1, n + 4):
        try:
            EvictionConfig.from_spec(spec, budget, **options_for(spec))
        except ValueError:
            continue
        out.append(budget)
    return tuple(out)


@st.composite
def cases(draw, spec: str):
    """(budget, inputs builder) for one step of ``spec``."""
    h_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3, 7]))
    d = draw(st.sampled_from([8, 16]))
    n = draw(st.integers(1, 80))
    budgets = valid_budgets(spec, n)
    if not budgets:
        budgets = valid_budgets(spec, 80)
        n = 80
    budget = draw(st.sampled_from(budgets))
    phase = draw(st.sampled_from(list(Phase)))
    num_new = 1 if phase is Phase.DECODE else draw(st.integers(1, n))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    layer = draw(st.integers(0, 3))
    return budget, dict(h_kv=h_kv, group=group, n=n, d=d, num_new=num_new, seed=seed, layer=layer, phase=phase)


def build(spec: str, budget: int) -> Policy:
    return EvictionConfig.from_spec(spec, budget, **options_for(spec)).build_policy()


def inputs_for(policy: Policy, h_kv, group, n, d, num_new, seed, layer, phase) -> EvictionInputs:
    w = window_for(policy, n, num_new)
    inp = make_inputs(h_kv, group, n, d, w, seed=seed, phase=phase)
    # A longer prompt than the cache holds, as after earlier evictions (shift every position by 5).
    inp = dataclasses.replace(inp, num_new=num_new, layer=layer, seq_len=n + 5,
                              positions=inp.positions + 5, query_positions=inp.query_positions + 5)
    return with_initial_state(policy, inp)


def clone_inputs(inp: EvictionInputs) -> EvictionInputs:
    cloned = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
    for key, value in cloned.items():
        if isinstance(value, torch.Tensor):
            cloned[key] = value.clone()
    cloned["state"] = {k: v.clone() for k, v in inp.state.items()}
    return EvictionInputs(**cloned)


@pytest.mark.parametrize("spec", SPECS)
def test_step_contract(spec):
    @SETTINGS
    @given(case=cases(spec))
    def check(case):
        budget, shape = case
        policy = build(spec, budget)
        inp = inputs_for(policy, **shape)
        original = clone_inputs(inp)
        h_kv, n = shape["h_kv"], shape["n"]

        result = policy.step(inp, budget)

        # The inputs (K, V, queries, state) are not modified in place.
        for f in dataclasses.fields(inp):
            a, b = getattr(inp, f.name), getattr(original, f.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{spec} modified inputs.{f.name}"
        assert inp.state.keys() == original.state.keys()
        assert all(torch.equal(inp.state[k], original.state[k]) for k in inp.state), f"{spec} mutated state"

        # Every state tensor the policy declares covers the n candidates, in fp32.
        for name in policy.state_names:
            assert name in result.state, f"{spec} dropped state {name!r}"
            assert result.state[name].shape == (h_kv, n) and result.state[name].dtype == torch.float32

        if budget >= n:
            assert result.keep is None
            return
        keep = result.keep
        assert keep is not None and keep.shape == (h_kv, budget) and keep.dtype == torch.int64
        assert (keep >= 0).all() and (keep < n).all()
        assert (keep[:, 1:] > keep[:, :-1]).all(), f"{spec}: keep must be strictly ascending (unique)"

        # Protected tokens are always kept, and score +inf (asked as ``step`` asks: with the budget set).
        scored = dataclasses.replace(inp, state=result.state, budget=budget)
        protected = policy.protected_mask(scored)
        assert protected.shape == (h_kv, n) and protected.dtype == torch.bool
        kept = torch.zeros(h_kv, n, dtype=torch.bool).scatter_(1, keep, True)
        assert not (protected & ~kept).any(), f"{spec} evicted a protected token"
        scores = policy.scores(scored)
        assert scores.shape == (h_kv, n) and scores.dtype == torch.float32
        assert not torch.isnan(scores).any()
        assert torch.isposinf(scores[protected]).all()

        if policy.is_attention_mass:
            mass = policy.attention_mass(scored)
            assert mass.shape == (h_kv, n) and torch.isfinite(mass).all() and (mass >= 0).all()

        # Deterministic given the inputs and the seed: a fresh policy on fresh copies agrees exactly.
        again = build(spec, budget).step(clone_inputs(original), budget)
        assert torch.equal(again.keep, keep)
        assert again.state.keys() == result.state.keys()
        assert all(torch.equal(again.state[k], result.state[k]) for k in result.state)

    check()


@pytest.mark.parametrize("spec", EQUIVARIANT)
def test_slot_order_does_not_matter(spec):
    """Compaction may reorder slots; scores follow the tokens (masks and pooling use logical positions)."""
    @SETTINGS
    @given(case=cases(spec), perm_seed=st.integers(0, 2 ** 31 - 1))
    def check(case, perm_seed):
        budget, shape = case
        policy = build(spec, budget)
        inp = inputs_for(policy, **shape)
        h_kv, n = shape["h_kv"], shape["n"]
        gen = torch.Generator().manual_seed(perm_seed)
        perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(h_kv)])  # differs per head
        shuffled = dataclasses.replace(
            inp, keys=torch.gather(inp.keys, 1, perm.unsqueeze(-1).expand_as(inp.keys)),
            values=torch.gather(inp.values, 1, perm.unsqueeze(-1).expand_as(inp.values)),
            positions=torch.gather(inp.positions, 1, perm),
            state={k: torch.gather(v, 1, perm) for k, v in inp.state.items()})
        state = policy.update_state(inp)
        state_shuffled = policy.update_state(shuffled)
        for k in state:
            torch.testing.assert_close(state_shuffled[k], torch.gather(state[k], 1, perm), rtol=1e-5, atol=1e-6)
        expected = torch.gather(policy.scores(inp.with_state(state)), 1, perm)
        got = policy.scores(shuffled.with_state(state_shuffled))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)

    check()

