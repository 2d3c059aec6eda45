"""Contract properties every registered policy (and every meta score over every attention-mass base) must satisfy,
over random batches: R >= 1 rows of different lengths padded to a common width (junk in the padding),
windows in ring order with empty entries, GQA group sizes, phases and per-row budgets (see
``vllm_evict/policies/base.py``)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs, Phase, Policy

from .helpers import (SPECS, build, check_keep_layout, make_inputs, options_for, stack_rows, window_for, with_budget,
                      with_initial_state)

# Deterministic, slot-order-free policies: permuting the slots must permute the scores.
EQUIVARIANT = ("snapkv", "h2o", "tova", "streamingllm", "knorm", "keydiff", "ahakv")

MAX_LEN = 48
SETTINGS = settings(max_examples=25, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def valid_budgets(spec: str) -> tuple[int, ...]:
    """Budgets up to MAX_LEN that ``from_spec`` accepts (the protected tokens must fit)."""
    out = []
    for budget in range(1, MAX_LEN + 1):
        try:
            EvictionConfig.from_spec(spec, budget, **options_for(spec))
        except ValueError:
            continue
        out.append(budget)
    return tuple(out)


@dataclasses.dataclass
class Case:
    h_kv: int
    group: int
    d: int
    phase: Phase
    layer: int
    lengths: list[int]
    num_new: list[int]
    seeds: list[int]
    budgets: list[int] | None  # None: a step that evicts nothing
    pad: int  # padding slots beyond the longest row
    pad_window: int  # empty window entries beyond the widest row
    roll: bool  # window entries in ring order


@st.composite
def cases(draw, spec: str) -> Case:
    """One step of ``spec`` over 1-3 rows; when evicting, each row's budget is valid and <= its length."""
    evicting = draw(st.booleans())
    low = min(valid_budgets(spec)) if evicting else 1
    rows = draw(st.integers(1, 3))
    phase = draw(st.sampled_from(list(Phase)))
    lengths = [draw(st.integers(low, MAX_LEN)) for _ in range(rows)]
    num_new = [1 if phase is Phase.DECODE else draw(st.integers(1, n)) for n in lengths]
    budgets = None
    if evicting:
        budgets = [draw(st.sampled_from([b for b in valid_budgets(spec) if b <= n])) for n in lengths]
    return Case(h_kv=draw(st.integers(1, 3)), group=draw(st.sampled_from([1, 3, 7])), d=draw(st.sampled_from([8, 16])),
                phase=phase, layer=draw(st.integers(0, 3)), lengths=lengths, num_new=num_new,
                seeds=[draw(st.integers(0, 2 ** 31 - 1)) for _ in range(rows)], budgets=budgets,
                pad=draw(st.integers(0, 3)), pad_window=draw(st.integers(0, 2)), roll=draw(st.booleans()))


def policy_for(spec: str, case: Case) -> Policy:
    return build(spec, min(case.budgets) if case.budgets else min(valid_budgets(spec)))


def row_inputs(policy: Policy, case: Case, r: int) -> EvictionInputs:
    """Row r alone: a longer prompt than the cache holds, as after earlier evictions (positions + 5)."""
    n, new = case.lengths[r], case.num_new[r]
    inp = make_inputs(case.h_kv, case.group, n, case.d, window_for(policy, n, new), seed=case.seeds[r],
                      phase=case.phase)
    o_proj = make_inputs(case.h_kv, case.group, 1, case.d, 0, seed=case.seeds[0]).o_proj  # shared by the batch
    inp = inp.evolve(num_new=torch.tensor([new]), layer=case.layer, seq_len=inp.seq_len + 5, max_seq_len=inp.max_seq_len + 5,
                     positions=inp.positions + 5, query_positions=inp.query_positions + 5, o_proj=o_proj)
    return with_initial_state(policy, inp)


def batch_for(policy: Policy, case: Case, junk_seed: int = 0) -> EvictionInputs:
    rows = [row_inputs(policy, case, r) for r in range(len(case.lengths))]
    window = max(r.queries.shape[2] for r in rows) + case.pad_window
    inp = stack_rows(rows, width=max(case.lengths) + case.pad, window=window, junk_seed=junk_seed, roll=case.roll)
    return with_budget(inp, case.budgets)


def clone_inputs(inp: EvictionInputs) -> EvictionInputs:
    cloned = {f.name: getattr(inp, f.name) for f in dataclasses.fields(inp)}
    for key, value in cloned.items():
        if isinstance(value, torch.Tensor):
            cloned[key] = value.clone()
    cloned["state"] = {k: v.clone() for k, v in inp.state.items()}
    return EvictionInputs(**cloned)


def real(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Each row's real slots of an [R, H, N] tensor."""
    return [x[r, :, :n] for r, n in enumerate(lengths)]


@pytest.mark.parametrize("spec", SPECS)
def test_step_contract(spec):
    @SETTINGS
    @given(case=cases(spec))
    def check(case):
        policy = policy_for(spec, case)
        inp = batch_for(policy, case)
        original = clone_inputs(inp)
        rows, h_kv, width = len(case.lengths), case.h_kv, inp.width
        shape = (rows, h_kv, width)
        valid = inp.valid.expand(shape)

        result = policy.step(inp)

        # The inputs (K, V, queries, budget, state) are not modified in place.
        for f in dataclasses.fields(inp):
            a, b = getattr(inp, f.name), getattr(original, f.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"{spec} modified inputs.{f.name}"
        assert inp.state.keys() == original.state.keys()
        assert all(torch.equal(inp.state[k], original.state[k]) for k in inp.state), f"{spec} mutated state"

        # Every state tensor the policy declares covers every slot, in fp32.
        for name in policy.state_names:
            assert name in result.state, f"{spec} dropped state {name!r}"
            assert result.state[name].shape == shape and result.state[name].dtype == torch.float32

        if case.budgets is None:
            assert result.keep is None
            return
        keep = result.keep
        assert keep is not None and keep.shape == (rows, h_kv, max(case.budgets))
        check_keep_layout(keep, inp.budget, inp.lengths, width)  # no padding slot is ever kept

        # Protected tokens are always kept, and score +inf (asked as ``step`` asks: with the budget set).
        scored = inp.with_state(result.state)
        protected = policy.protected_mask(scored)
        assert protected.shape == shape and protected.dtype == torch.bool
        assert not (protected & ~valid).any(), f"{spec} protects a padding slot"
        kept = torch.zeros(rows, h_kv, width + 1, dtype=torch.bool).scatter_(2, keep, True)[..., :width]
        assert not (protected & ~kept).any(), f"{spec} evicted a protected token"
        assert (kept.sum(dim=-1) == inp.budget.view(-1, 1)).all()
        scores = policy.scores(scored)
        assert scores.shape == shape and scores.dtype == torch.float32
        assert not torch.isnan(scores[valid]).any()
        assert torch.isposinf(scores[protected]).all()

        if policy.is_attention_mass:
            mass = policy.attention_mass(scored)
            assert mass.shape == shape and torch.isfinite(mass).all() and (mass >= 0).all()
            assert policy.mass_rows(scored).shape == (rows,)

        # Deterministic given the inputs and the seed: a fresh policy on fresh copies agrees exactly.
        again = policy_for(spec, case).step(clone_inputs(original))
        assert torch.equal(again.keep, keep)
        assert again.state.keys() == result.state.keys()
        assert all(torch.equal(again.state[k], result.state[k]) for k in result.state)

        # Each row scores as it would alone (a 1-row batch without padding): the same protected tokens, and
        # the same state and scores up to rounding (reductions over a padded axis may round differently).
        for r, n in enumerate(case.lengths):
            alone = with_budget(row_inputs(policy, case, r), case.budgets[r])
            solo = policy.step(alone)
            solo_scored = alone.with_state(solo.state)
            assert torch.equal(policy.protected_mask(solo_scored)[0], protected[r, :, :n]), f"{spec} row {r}"
            for k in solo.state:
                torch.testing.assert_close(result.state[k][r, :, :n], solo.state[k][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(scores[r, :, :n], policy.scores(solo_scored)[0], rtol=1e-5, atol=1e-6)

        # Padding never leaks: other junk in every padding slot and empty window entry changes nothing
        # on a real slot (same shapes, so the same arithmetic: bit for bit).
        other = batch_for(policy, case, junk_seed=1)
        assert torch.equal(other.keys, inp.keys) == all(n == width for n in case.lengths)
        moved = policy.step(other)
        assert torch.equal(moved.keep, keep), f"{spec}: padding changed the kept slots"
        for k in result.state:
            for a, b in zip(real(moved.state[k], case.lengths), real(result.state[k], case.lengths)):
                assert torch.equal(a, b), f"{spec}: padding changed state {k!r} of a real slot"
        for a, b in zip(real(policy.scores(other.with_state(moved.state)), case.lengths), real(scores, case.lengths)):
            assert torch.equal(a, b), f"{spec}: padding changed a real slot's score"

    check()


def permute_real_slots(inp: EvictionInputs, gen: torch.Generator) -> tuple[EvictionInputs, torch.Tensor]:
    """The inputs with each row's real slots shuffled, differently per head (padding stays put), and the
    permutation [R, H, N] (new slot j holds old slot perm[..., j])."""
    rows, heads, width = inp.positions.shape
    perm = torch.arange(width).repeat(rows, heads, 1)
    for r in range(rows):
        n = int(inp.lengths[r])
        for h in range(heads):
            perm[r, h, :n] = torch.randperm(n, generator=gen)

    def move(x: torch.Tensor) -> torch.Tensor:
        index = perm.view(*perm.shape, *([1] * (x.dim() - 3))).expand_as(x)
        return torch.gather(x, 2, index)

    shuffled = inp.evolve(keys=move(inp.keys), values=move(inp.values), positions=move(inp.positions),
                          state={k: move(v) for k, v in inp.state.items()})
    return shuffled, perm


@pytest.mark.parametrize("spec", EQUIVARIANT)
def test_slot_order_does_not_matter(spec):
    """Compaction may reorder slots; scores follow the tokens (masks and pooling use logical positions)."""
    @SETTINGS
    @given(case=cases(spec), perm_seed=st.integers(0, 2 ** 31 - 1))
    def check(case, perm_seed):
        policy = policy_for(spec, case)
        inp = batch_for(policy, case)
        shuffled, perm = permute_real_slots(inp, torch.Generator().manual_seed(perm_seed))
        state = policy.update_state(inp)
        state_shuffled = policy.update_state(shuffled)
        for k in state:
            for a, b in zip(real(state_shuffled[k], case.lengths), real(torch.gather(state[k], 2, perm), case.lengths)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        expected = torch.gather(policy.scores(inp.with_state(state)), 2, perm)
        got = policy.scores(shuffled.with_state(state_shuffled))
        for a, b in zip(real(got, case.lengths), real(expected, case.lengths)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    check()
