"""H2O: attention accumulated over every query since a token arrived (caote.md §3.1, §9.4)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs, compact
from vllm_evict.policies.h2o import H2O

from .helpers import group_mean, make_inputs, naive_attention_rows, with_initial_state


def naive_block_mass(inp: EvictionInputs) -> torch.Tensor:
    """(1/G) sum_g sum_i A^(g)_ij over the step's queries, by hand: [H_kv, n] float64."""
    rows = naive_attention_rows(inp.keys, inp.positions, inp.queries, inp.query_positions, inp.scale)
    return group_mean(rows.sum(dim=1), inp.num_kv_heads)


def test_class_contract():
    p = H2O()
    assert p.name == "h2o" and p.summary and p.paper
    assert p.state_names == ("acc",)
    assert p.needs_every_step is True
    assert p.query_window is None
    assert p.is_attention_mass is True and p.one_shot is False
    assert p.options == {"recent": 0, "sinks": 0}
    assert p.protected_count(100) == 0
    assert H2O(recent=3, sinks=2).protected_count(100) == 5


def test_uniform_attention_by_hand():
    """All-zero keys: query i sees positions 0..i uniformly, so column j collects sum_{i>=j} 1/(i+1)."""
    h = 1
    keys = torch.zeros(h, 4, 2)
    inp = EvictionInputs(keys=keys, values=keys.clone(), positions=torch.arange(4).view(1, 4),
                         queries=torch.randn(1, 4, 2), query_positions=torch.arange(4), scale=1.0,
                         seq_len=4, num_new=4)
    p = H2O()
    state = p.update_state(with_initial_state(p, inp))
    expected = torch.tensor([[25 / 12, 13 / 12, 7 / 12, 3 / 12]])
    torch.testing.assert_close(state["acc"], expected)
    # Theorem D.1 of CAOTE: without eviction the total equals the number of queries processed.
    assert state["acc"].sum().item() == pytest.approx(4.0)


def test_new_tokens_start_at_zero():
    p = H2O()
    keys = torch.randn(2, 5, 8)
    init = p.init_state(keys, keys.clone(), None)
    assert set(init) == {"acc"}
    assert init["acc"].shape == (2, 5) and init["acc"].dtype == torch.float32
    assert torch.all(init["acc"] == 0)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_two_steps_equal_sum_of_explicit_column_sums(group):
    """Step 1 prefills 6 tokens; step 2 appends 4 more. acc = step-1 mass (old tokens) + step-2 mass."""
    h_kv, d = 2, 8
    full = make_inputs(h_kv, group, n=10, d=d, w=10, seed=group)
    p = H2O()

    first = EvictionInputs(keys=full.keys[:, :6], values=full.values[:, :6], positions=full.positions[:, :6],
                           queries=full.queries[:, :6], query_positions=full.query_positions[:6],
                           scale=full.scale, seq_len=6, num_new=6)
    r1 = p.step(with_initial_state(p, first), budget=None)
    assert r1.keep is None
    torch.testing.assert_close(r1.state["acc"].double(), naive_block_mass(first), rtol=1e-5, atol=1e-6)

    new = p.init_state(full.keys[:, 6:], full.values[:, 6:], None)
    second = EvictionInputs(keys=full.keys, values=full.values, positions=full.positions,
                            queries=full.queries[:, 6:], query_positions=full.query_positions[6:],
                            scale=full.scale, seq_len=10, num_new=4,
                            state={"acc": torch.cat([r1.state["acc"], new["acc"]], dim=1)})
    r2 = p.step(second, budget=None)
    expected = torch.cat([naive_block_mass(first), torch.zeros(h_kv, 4, dtype=torch.float64)], dim=1)
    expected += naive_block_mass(second)
    torch.testing.assert_close(r2.state["acc"].double(), expected, rtol=1e-5, atol=1e-6)
    # Equivalently: one pass over all 10 queries gives the same totals (accumulation is additive).
    torch.testing.assert_close(r2.state["acc"].double(), naive_block_mass(full), rtol=1e-5, atol=1e-6)


def test_causal_mask_by_position():
    """A query never pays attention to a key at a later logical position, whatever the slot order."""
    inp = make_inputs(1, 2, n=6, d=4, w=1, seed=3)
    # Shuffle the slots and ask about a query at position 2: keys at positions 3, 4, 5 must get nothing.
    perm = torch.tensor([[4, 0, 5, 2, 1, 3]])
    inp = EvictionInputs(keys=inp.keys[:, perm[0]], values=inp.values[:, perm[0]], positions=perm,
                         queries=inp.queries, query_positions=torch.tensor([2]), scale=inp.scale,
                         seq_len=6, num_new=1)
    p = H2O()
    acc = p.update_state(with_initial_state(p, inp))["acc"]
    assert torch.all(acc[perm >= 3] == 0)
    assert torch.all(acc[perm < 3] > 0)
    assert acc.sum().item() == pytest.approx(1.0)


def test_state_survives_compaction_and_positions_stay_logical():
    """Evict, compact the state with the KV, then accumulate again over non-contiguous positions."""
    p = H2O()
    full = make_inputs(1, 3, n=12, d=8, w=12, seed=7)
    first = EvictionInputs(keys=full.keys[:, :8], values=full.values[:, :8], positions=full.positions[:, :8],
                           queries=full.queries[:, :8], query_positions=full.query_positions[:8],
                           scale=full.scale, seq_len=8, num_new=8)
    r1 = p.step(with_initial_state(p, first), budget=5)
    assert r1.keep.shape == (1, 5)
    # The survivors are the 5 largest accumulated masses.
    expected_keep = torch.sort(torch.topk(r1.state["acc"], 5, dim=-1).indices, dim=-1).values
    assert torch.equal(r1.keep, expected_keep)
    keys = torch.cat([compact(first.keys, r1.keep), full.keys[:, 8:]], dim=1)
    values = torch.cat([compact(first.values, r1.keep), full.values[:, 8:]], dim=1)
    positions = torch.cat([compact(first.positions, r1.keep), full.positions[:, 8:]], dim=1)
    acc = torch.cat([compact(r1.state["acc"], r1.keep), torch.zeros(1, 4)], dim=1)
    second = EvictionInputs(keys=keys, values=values, positions=positions, queries=full.queries[:, 8:],
                            query_positions=full.query_positions[8:], scale=full.scale, seq_len=12,
                            num_new=4, state={"acc": acc})
    r2 = p.step(second, budget=None)
    expected = acc.double() + naive_block_mass(second)
    torch.testing.assert_close(r2.state["acc"].double(), expected, rtol=1e-5, atol=1e-6)


def test_state_updated_every_step_and_input_untouched():
    p = H2O()
    inp = with_initial_state(p, make_inputs(2, 3, n=9, d=8, w=3, seed=1))
    before = inp.state["acc"].clone()
    r = p.step(inp, budget=None)  # no eviction, but the accumulator must still move
    assert r.keep is None
    assert torch.all(r.state["acc"] > 0)
    assert torch.equal(inp.state["acc"], before)


def test_scores_and_protection():
    p = EvictionConfig.from_spec("h2o", 6, recent=2, sinks=1).build_policy()
    assert isinstance(p, H2O) and p.recent == 2 and p.sinks == 1
    inp = make_inputs(2, 3, n=12, d=8, w=12, seed=5)
    r = p.step(with_initial_state(p, inp), budget=6)
    for h in range(2):
        kept = set(r.keep[h].tolist())
        assert {0, 10, 11} <= kept  # sink position 0 and the 2 most recent
        # The other 3 are the heaviest of the unprotected tokens.
        acc = r.state["acc"][h].clone()
        acc[[0, 10, 11]] = float("-inf")
        assert kept - {0, 10, 11} == set(torch.topk(acc, 3).indices.tolist())
    s = p.scores(inp.with_state(r.state))
    assert torch.isinf(s[:, [0, 10, 11]]).all() and torch.isfinite(s[:, 1:10]).all()
    torch.testing.assert_close(p.attention_mass(inp.with_state(r.state)), r.state["acc"])


def test_default_config_protects_nothing():
    cfg = EvictionConfig.from_spec("h2o", 4)
    assert cfg.schedule == "chunked"
    p = cfg.build_policy()
    inp = with_initial_state(p, make_inputs(1, 1, n=10, d=4, w=10, seed=2))
    assert not p.protected_mask(inp).any()


@pytest.mark.parametrize(("options", "message"), [
    ({"recent": -1}, "recent must be an integer >= 0, got -1"),
    ({"sinks": -2}, "sinks must be an integer >= 0, got -2"),
    ({"recent": 1.5}, "recent must be an integer >= 0, got 1.5"),
    ({"sinks": "4"}, "sinks must be an integer >= 0, got '4'"),
    ({"recent": True}, "recent must be an integer >= 0, got True"),
    ({"window": 4}, "unknown option 'window' for h2o; valid options: budget, policy, recent, schedule, "
                    "seed, sinks, slack"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("h2o", 64, **options)


def test_budget_must_exceed_protected():
    with pytest.raises(ValueError, match=re.escape(
            "budget 5 must be larger than the 5 tokens h2o always keeps (sinks 1 + recent 4)")):
        EvictionConfig.from_spec("h2o", 5, recent=4, sinks=1)
