"""H2O: attention accumulated over every query since a token arrived (caote.md §3.1, §9.4)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs
from vllm_evict.policies.h2o import H2O

from .helpers import compact, group_mean, make_inputs, naive_rows_of, one_row, step, with_budget, with_initial_state


def naive_block_mass(inp: EvictionInputs) -> torch.Tensor:
    """(1/G) sum_g sum_i A^(g)_ij over the step's queries of row 0, by hand: [H_kv, n] float64."""
    return group_mean(naive_rows_of(inp).sum(dim=1), inp.num_kv_heads)


def cut(full: EvictionInputs, n: int, queries: slice, num_new: int, state: dict | None = None) -> EvictionInputs:
    """Row 0 of ``full`` restricted to its first ``n`` candidates and the queries ``queries``."""
    return one_row(full.keys[0, :, :n], full.values[0, :, :n], full.positions[0, :, :n],
                   full.queries[0, :, queries], full.query_positions[0, queries], full.scale,
                   seq_len=n, num_new=num_new, state=state)


def test_class_contract():
    p = H2O()
    assert p.name == "h2o" and p.summary and p.paper
    assert p.state_names == ("acc",)
    assert p.needs_every_step is True
    assert p.query_window is None
    assert p.is_attention_mass is True and p.one_shot is True  # the release evicts after the prompt
    assert p.options == {"recent": None, "sinks": 0, "accumulate": "sum"}
    assert p.protected_count(100) == 50  # the paper's equal heavy / recent split
    assert p.protected_count(101) == 50
    assert H2O(recent=3, sinks=2).protected_count(100) == 5
    assert H2O(recent=0).protected_count(100) == 0


def test_uniform_attention_by_hand():
    """All-zero keys: query i sees positions 0..i uniformly, so column j collects sum_{i>=j} 1/(i+1)."""
    h = 1
    keys = torch.zeros(h, 4, 2)
    inp = one_row(keys, keys.clone(), torch.arange(4).view(1, 4), torch.randn(1, 4, 2), torch.arange(4),
                  scale=1.0, seq_len=4, num_new=4)
    p = H2O()
    state = p.update_state(with_initial_state(p, inp))
    expected = torch.tensor([[[25 / 12, 13 / 12, 7 / 12, 3 / 12]]])
    torch.testing.assert_close(state["acc"], expected)
    # Theorem D.1 of CAOTE: without eviction the total equals the number of queries processed.
    assert state["acc"].sum().item() == pytest.approx(4.0)


def test_new_tokens_start_at_zero():
    p = H2O()
    keys = torch.randn(2, 5, 8)
    # acc is not computed from K/V: the engine writes 0 for every new token (``computed_state`` says which
    # states init_state computes; the rest start at 0), and init_state returns nothing for it.
    assert p.computed_state == () and p.init_state(keys, keys.clone(), None) == {}
    init = with_initial_state(p, make_inputs(2, 1, n=5, d=8, w=5)).state
    assert set(init) == {"acc"}
    assert init["acc"].shape == (1, 2, 5) and init["acc"].dtype == torch.float32
    assert torch.all(init["acc"] == 0)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_two_steps_equal_sum_of_explicit_column_sums(group):
    """Step 1 prefills 6 tokens; step 2 appends 4 more. acc = step-1 mass (old tokens) + step-2 mass."""
    h_kv, d = 2, 8
    full = make_inputs(h_kv, group, n=10, d=d, w=10, seed=group)
    p = H2O()

    first = cut(full, 6, slice(0, 6), num_new=6)
    r1 = step(p, with_initial_state(p, first), None)
    assert r1.keep is None
    torch.testing.assert_close(r1.state["acc"][0].double(), naive_block_mass(first), rtol=1e-5, atol=1e-6)

    # The 4 new tokens enter with acc = 0.
    second = cut(full, 10, slice(6, 10), num_new=4,
                 state={"acc": torch.cat([r1.state["acc"][0], torch.zeros(h_kv, 4)], dim=1)})
    r2 = step(p, second, None)
    expected = torch.cat([naive_block_mass(first), torch.zeros(h_kv, 4, dtype=torch.float64)], dim=1)
    expected += naive_block_mass(second)
    torch.testing.assert_close(r2.state["acc"][0].double(), expected, rtol=1e-5, atol=1e-6)
    # Equivalently: one pass over all 10 queries gives the same totals (accumulation is additive).
    torch.testing.assert_close(r2.state["acc"][0].double(), naive_block_mass(full), rtol=1e-5, atol=1e-6)


def test_causal_mask_by_position():
    """A query never pays attention to a key at a later logical position, whatever the slot order."""
    inp = make_inputs(1, 2, n=6, d=4, w=1, seed=3)
    # Shuffle the slots and ask about a query at position 2: keys at positions 3, 4, 5 must get nothing.
    perm = torch.tensor([[4, 0, 5, 2, 1, 3]])
    inp = one_row(inp.keys[0][:, perm[0]], inp.values[0][:, perm[0]], perm, inp.queries[0], torch.tensor([2]),
                  inp.scale, seq_len=6, num_new=1)
    p = H2O()
    acc = p.update_state(with_initial_state(p, inp))["acc"][0]
    assert torch.all(acc[perm >= 3] == 0)
    assert torch.all(acc[perm < 3] > 0)
    assert acc.sum().item() == pytest.approx(1.0)


def test_state_survives_compaction_and_positions_stay_logical():
    """Evict, compact the state with the KV, then accumulate again over non-contiguous positions."""
    p = H2O(recent=0)
    full = make_inputs(1, 3, n=12, d=8, w=12, seed=7)
    first = cut(full, 8, slice(0, 8), num_new=8)
    r1 = step(p, with_initial_state(p, first), 5)
    assert r1.keep.shape == (1, 1, 5)
    keep, acc1 = r1.keep[0], r1.state["acc"][0]
    # The survivors are the 5 largest accumulated masses.
    expected_keep = torch.sort(torch.topk(acc1, 5, dim=-1).indices, dim=-1).values
    assert torch.equal(keep, expected_keep)
    keys = torch.cat([compact(first.keys[0], keep), full.keys[0, :, 8:]], dim=1)
    values = torch.cat([compact(first.values[0], keep), full.values[0, :, 8:]], dim=1)
    positions = torch.cat([compact(first.positions[0], keep), full.positions[0, :, 8:]], dim=1)
    acc = torch.cat([compact(acc1, keep), torch.zeros(1, 4)], dim=1)
    second = one_row(keys, values, positions, full.queries[0, :, 8:], full.query_positions[0, 8:], full.scale,
                     seq_len=12, num_new=4, state={"acc": acc})
    r2 = step(p, second, None)
    expected = acc.double() + naive_block_mass(second)
    torch.testing.assert_close(r2.state["acc"][0].double(), expected, rtol=1e-5, atol=1e-6)


def test_state_updated_every_step_and_input_untouched():
    p = H2O()
    inp = with_initial_state(p, make_inputs(2, 3, n=9, d=8, w=3, seed=1))
    before = inp.state["acc"].clone()
    r = step(p, inp, None)  # no eviction, but the accumulator must still move
    assert r.keep is None
    assert torch.all(r.state["acc"] > 0)
    assert torch.equal(inp.state["acc"], before)


def test_scores_and_protection():
    p = EvictionConfig.from_spec("h2o", 6, recent=2, sinks=1).build_policy()
    assert isinstance(p, H2O) and p.recent == 2 and p.sinks == 1
    inp = make_inputs(2, 3, n=12, d=8, w=12, seed=5)
    r = step(p, with_initial_state(p, inp), 6)
    for h in range(2):
        kept = set(r.keep[0, h].tolist())
        assert {0, 10, 11} <= kept  # sink position 0 and the 2 most recent
        # The other 3 are the heaviest of the unprotected tokens.
        acc = r.state["acc"][0, h].clone()
        acc[[0, 10, 11]] = float("-inf")
        assert kept - {0, 10, 11} == set(torch.topk(acc, 3).indices.tolist())
    s = p.scores(inp.with_state(r.state))[0]
    assert torch.isinf(s[:, [0, 10, 11]]).all() and torch.isfinite(s[:, 1:10]).all()
    torch.testing.assert_close(p.attention_mass(inp.with_state(r.state)), r.state["acc"])


def test_default_config_keeps_half_the_budget_recent():
    cfg = EvictionConfig.from_spec("h2o", 4)
    assert cfg.schedule == "oneshot"
    p = cfg.build_policy()
    inp = with_initial_state(p, make_inputs(1, 1, n=10, d=4, w=10, seed=2))
    assert not p.protected_mask(inp).any()  # a step that evicts nothing protects nothing
    assert p.protected_mask(with_budget(inp, 4))[0, 0].tolist() == [False] * 8 + [True] * 2
    assert p.protected_mask(with_budget(inp, 7))[0, 0].tolist() == [False] * 7 + [True] * 3
    # The other half of the budget goes to the heaviest of the older tokens.
    r = step(p, inp, 6)
    acc = r.state["acc"][0, 0].clone()
    acc[7:] = float("-inf")
    assert set(r.keep[0, 0].tolist()) == {7, 8, 9} | set(torch.topk(acc, 3).indices.tolist())
    assert not EvictionConfig.from_spec("h2o", 4, recent=0).build_policy().protected_mask(with_budget(inp, 4)).any()


def test_mean_accumulation_divides_by_the_queries_that_saw_each_token():
    """accumulate="mean": kvpress's observed-attention score, acc_j / (seq_len - pos_j)."""
    p = H2O(accumulate="mean", recent=0)
    inp = with_initial_state(p, make_inputs(2, 3, n=12, d=8, w=12, seed=4))
    state = p.update_state(inp)
    got = p.attention_mass(inp.with_state(state))
    seen = (12 - torch.arange(12)).float()
    torch.testing.assert_close(got, state["acc"] / seen)
    assert p.mass_rows(inp).tolist() == [1] and H2O().mass_rows(inp).tolist() == [12]
    # Ranking by the mean is not ranking by the sum: early tokens lose their head start.
    r_mean, r_sum = step(p, inp, 5), step(H2O(recent=0), inp, 5)
    assert not torch.equal(r_mean.keep, r_sum.keep)


@pytest.mark.parametrize(("options", "message"), [
    ({"recent": -1}, "recent must be an integer in [0, 2147483647], got -1"),
    ({"sinks": -2}, "sinks must be an integer in [0, 2147483647], got -2"),
    ({"recent": 1.5}, "recent must be an integer in [0, 2147483647], got 1.5"),
    ({"sinks": "4"}, "sinks must be an integer in [0, 2147483647], got '4'"),
    ({"recent": True}, "recent must be an integer in [0, 2147483647], got True"),
    ({"accumulate": "max"}, "accumulate must be one of sum, mean; got 'max'"),
    ({"window": 4}, "unknown option 'window' for h2o; valid options: accumulate, budget, mode, policy, recent, "
                    "schedule, seed, sinks, slack"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("h2o", 64, **options)


def test_budget_must_exceed_protected():
    with pytest.raises(ValueError, match=re.escape(
            "budget 5 must be larger than the 5 tokens h2o always keeps (sinks 1 + recent 4)")):
        EvictionConfig.from_spec("h2o", 5, recent=4, sinks=1)
