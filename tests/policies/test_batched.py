"""The batched contract itself: a row's result never depends on the other rows of its batch, on the
padding, or (for the random draws) on the slot order, the position dtype or the device; random draws
are keyed by the global KV head, so tensor-parallel ranks draw what one rank would.

Fixed seeds (not hypothesis): these compare kept slots exactly, and a row in a batch runs the same
arithmetic as alone except for reductions over padded axes, which may round differently (by about one
ulp); that can only flip the order of two scores tied to within rounding, which these cases avoid.
"""

from __future__ import annotations

import pytest
import torch

from vllm_evict.policies.base import EvictionInputs, Phase, Policy
from vllm_evict.policies.nacl import gumbel_noise
from vllm_evict.policies.random_policy import RandomPolicy, head_draws

from .helpers import (SPECS, build, check_keep_layout, make_inputs, stack_rows, window_for, with_budget,
                      with_initial_state)

# (length, budget, seq_len - length, num_new when not decoding, seed) of the rows of one mixed batch:
# different lengths (so padding), budgets (one keeps its whole row), logical lengths, new tokens, seeds.
ROWS = [(37, 20, 0, 5, 11), (12, 9, 7, 12, 12), (50, 33, 100, 1, 13), (29, 29, 3, 9, 14)]
HEADS, GROUP, D = 2, 3, 16


def row_inputs(policy: Policy, phase: Phase, index: int, o_proj: torch.Tensor | None = None) -> EvictionInputs:
    """Row ``index`` of ``ROWS`` alone, as a 1-row batch with its initial state."""
    n, _, shift, new, seed = ROWS[index]
    new = 1 if phase is Phase.DECODE else new
    inp = make_inputs(HEADS, GROUP, n, D, window_for(policy, n, new), seed=seed, phase=phase)
    inp = inp.evolve(positions=inp.positions + shift, query_positions=inp.query_positions + shift,
                     seq_len=inp.seq_len + shift, max_seq_len=inp.max_seq_len + shift, num_new=torch.tensor([new]), layer=2,
                     o_proj=inp.o_proj if o_proj is None else o_proj)
    return with_initial_state(policy, inp)


def mixed_batch(policy: Policy, phase: Phase, junk_seed: int = 0) -> tuple[list[EvictionInputs], EvictionInputs]:
    """The rows alone, and all of them in one batch (junk padding, windows rotated as in a ring)."""
    first = row_inputs(policy, phase, 0)
    rows = [first] + [row_inputs(policy, phase, i, first.o_proj) for i in range(1, len(ROWS))]
    return rows, stack_rows(rows, junk_seed=junk_seed, roll=True)


BUDGETS = [row[1] for row in ROWS]


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("spec", SPECS)
def test_mixed_batch_equals_rows_alone(spec, phase):
    policy = build(spec, min(BUDGETS))
    rows, batch = mixed_batch(policy, phase)
    for budgets in (None, BUDGETS):
        together = policy.step(with_budget(batch, budgets))
        if budgets is None:
            assert together.keep is None
        else:
            check_keep_layout(together.keep, torch.tensor(budgets), batch.lengths, batch.width)
        for r, alone_inp in enumerate(rows):
            n = int(alone_inp.lengths[0])
            alone = policy.step(with_budget(alone_inp, None if budgets is None else budgets[r]))
            assert together.state.keys() == alone.state.keys()
            for name in alone.state:
                torch.testing.assert_close(together.state[name][r, :, :n], alone.state[name][0], rtol=1e-6, atol=1e-6,
                                           msg=lambda m: f"{spec} row {r} state {name}: {m}")
            if budgets is not None:
                assert torch.equal(together.keep[r, :, : budgets[r]], alone.keep[0]), f"{spec} row {r}: kept slots"


@pytest.mark.parametrize("spec", SPECS)
def test_padding_is_never_kept_and_never_scored(spec):
    """Padding full of huge values (the most attractive keys and values there are) is never kept, even by
    a row that keeps all its tokens, and two different fillings give bit-identical results on every
    real slot: padding takes no part in any real slot's arithmetic."""
    policy = build(spec, min(BUDGETS))
    _, batch = mixed_batch(policy, Phase.PROMPT_END)
    batch = with_budget(batch, BUDGETS)
    pad = ~batch.valid.expand(batch.positions.shape)

    def filled(value: float) -> EvictionInputs:
        wide = pad.unsqueeze(-1).expand_as(batch.keys)
        return batch.evolve(keys=batch.keys.masked_fill(wide, value), values=batch.values.masked_fill(wide, value),
                            state={k: v.masked_fill(pad, abs(value)) for k, v in batch.state.items()})

    results = [policy.step(b) for b in (batch, filled(1e30), filled(-1e30))]
    scores = [policy.scores(b.with_state(res.state)) for b, res in zip((batch, filled(1e30), filled(-1e30)), results)]
    for res in results:
        check_keep_layout(res.keep, batch.budget, batch.lengths, batch.width)
    assert BUDGETS[3] == ROWS[3][0]  # row 3 keeps all its tokens: exactly its real slots
    assert (results[0].keep[3, :, : BUDGETS[3]] == torch.arange(ROWS[3][0])).all()
    for res, score in zip(results[1:], scores[1:]):
        assert torch.equal(res.keep, results[0].keep), spec
        for r, (n, *_) in enumerate(ROWS):
            for name in res.state:
                assert torch.equal(res.state[name][r, :, :n], results[0].state[name][r, :, :n]), (spec, name)
            assert torch.equal(score[r, :, :n], scores[0][r, :, :n]), spec


# ---- random draws -------------------------------------------------------------------------------------
STREAMS = [pytest.param(lambda inp: head_draws(inp), id="random"), pytest.param(gumbel_noise, id="nacl")]


@pytest.mark.parametrize("draws", STREAMS)
def test_draws_do_not_depend_on_the_batch(draws):
    """A row draws the same numbers alone, in any batch, at any padding width (bit for bit)."""
    policy = RandomPolicy()
    rows = [row_inputs(policy, Phase.PREFILL, i) for i in range(len(ROWS))]
    alone = [draws(r)[0] for r in rows]
    for picked, width, junk in (([0, 1, 2, 3], None, 0), ([3, 2, 1, 0], 80, 1), ([1, 2], None, 4)):
        got = draws(stack_rows([rows[i] for i in picked], width=width, junk_seed=junk))
        for r, i in enumerate(picked):
            assert torch.equal(got[r, :, : ROWS[i][0]], alone[i])


@pytest.mark.parametrize("draws", STREAMS)
def test_draws_follow_the_token_not_the_slot(draws):
    """Shuffled slots (as compaction may leave them) carry their draws with them; int32 positions (as the
    engine stores them) draw what int64 positions draw."""
    inp = row_inputs(RandomPolicy(), Phase.PREFILL, 2)
    gen = torch.Generator().manual_seed(0)
    perm = torch.stack([torch.randperm(inp.width, generator=gen) for _ in range(HEADS)]).unsqueeze(0)
    shuffled = inp.evolve(positions=torch.gather(inp.positions, 2, perm))
    assert torch.equal(draws(shuffled), torch.gather(draws(inp), 2, perm))
    assert torch.equal(draws(inp.evolve(positions=inp.positions.int())), draws(inp))


@pytest.mark.parametrize("draws", STREAMS)
def test_draws_are_keyed_by_the_global_head(draws):
    """Tensor parallel: the rank holding global KV heads 2-3 (head_offset 2) draws exactly what one rank
    holding all four heads draws for them, and not what heads 0-1 draw."""
    four = make_inputs(4, 1, 40, 8, 0, seed=3)
    two = make_inputs(2, 1, 40, 8, 0, seed=3)
    both = draws(four)
    assert torch.equal(draws(two.evolve(head_offset=2)), both[:, 2:])
    assert torch.equal(draws(two), both[:, :2])
    assert not torch.equal(both[:, :2], both[:, 2:])
    # ... and so do the kept slots of the random policy.
    whole = RandomPolicy().step(with_budget(four, 10))
    rank = RandomPolicy().step(with_budget(two.evolve(head_offset=2), 10))
    assert torch.equal(rank.keep, whole.keep[:, 2:])


@pytest.mark.parametrize("draws", STREAMS)
def test_draws_change_with_seed_layer_and_length_only(draws):
    inp = make_inputs(2, 1, 40, 8, 0, seed=3)
    base = draws(inp)
    for change in ({"seed": torch.tensor([4])}, {"layer": 1}, {"seq_len": torch.tensor([41])}):
        other = draws(inp.evolve(**change))
        assert not (other == base).any(), change  # every draw is fresh, not a shifted copy
    same = inp.evolve(keys=torch.randn_like(inp.keys), values=torch.randn_like(inp.values),
                      num_new=torch.tensor([3]), phase=Phase.DECODE, scale=0.3)
    assert torch.equal(draws(same), base)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draws", STREAMS)
def test_draws_are_the_same_on_gpu(draws):
    rows = [row_inputs(RandomPolicy(), Phase.PREFILL, i) for i in range(len(ROWS))]
    batch = stack_rows(rows)
    cuda = batch.evolve(**{name: getattr(batch, name).cuda() for name in
                           ("keys", "values", "positions", "lengths", "queries", "query_positions", "seq_len",
                            "num_new", "seed")})
    assert torch.equal(draws(cuda).cpu(), draws(batch))


# ---- rows with their own options ------------------------------------------------------------------------
# Per row of ROWS, a value of every numeric option (within each row's budget: 20, 9, 33, 29).
ROW_OPTIONS = {"window": [4, 2, 6, 3], "kernel": [7, 1, 3, 5], "sinks": [0, 2, 1, 3], "recent": [2, 1, 5, 3],
               "value_kernel": [5, 1, 7, 3], "proxy": [4, 2, 6, 3], "random_ratio": [7 / 19, 0.0, 0.5, 0.25],
               "temperature": [1.0, 0.5, 2.0, 1.5], "eps": [1e-6, 0.3, 0.01, 0.9], "alpha": [0.5, 0.25, 0.9, 1.0],
               "epsilon": [1e-4, 0.0, 0.5, 0.01]}


@pytest.mark.parametrize("phase", [Phase.PROMPT_END, Phase.DECODE])
@pytest.mark.parametrize("spec", SPECS)
def test_rows_with_their_own_options_equal_rows_alone(spec, phase):
    """One call over rows whose numeric options all differ (``EvictionInputs.row_options``: the engine
    batches the requests of a method whatever their options) keeps, per row, exactly what the row's own
    policy keeps alone."""
    from vllm_evict import EvictionConfig

    names = build(spec, min(BUDGETS)).row_option_names()
    policies = [EvictionConfig.from_spec(spec, BUDGETS[r], **{n: ROW_OPTIONS[n][r] for n in names}).build_policy()
                for r in range(len(ROWS))]
    first = row_inputs(policies[0], phase, 0)
    rows = [first] + [row_inputs(policies[r], phase, r, first.o_proj) for r in range(1, len(ROWS))]
    batch = stack_rows(rows, junk_seed=3, roll=True)
    batch = batch.evolve(
        row_options={n: torch.tensor(ROW_OPTIONS[n], dtype=torch.float64 if isinstance(ROW_OPTIONS[n][0], float)
                                     else torch.int64) for n in names},
        row_option_bounds={n: (min(ROW_OPTIONS[n]), max(ROW_OPTIONS[n])) for n in names})
    together = policies[0].step(with_budget(batch, BUDGETS))
    check_keep_layout(together.keep, torch.tensor(BUDGETS), batch.lengths, batch.width)
    for r, (policy, alone_inp) in enumerate(zip(policies, rows)):
        alone = policy.step(with_budget(alone_inp, BUDGETS[r]))
        assert torch.equal(together.keep[r, :, : BUDGETS[r]], alone.keep[0]), f"{spec} row {r}: kept slots"
        n = int(alone_inp.lengths[0])
        for name in alone.state:
            torch.testing.assert_close(together.state[name][r, :, :n], alone.state[name][0], rtol=1e-6, atol=1e-6)
