"""TOVA: the newest query's attention row, averaged over the layer's query heads (default) or over each GQA
group (``heads="group"``); ``attention_mass`` is the group mean either way (CAOTE's input, caote.md §3.1)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.tova import TOVA, layer_mean

from .helpers import group_mean, make_inputs, naive_rows_of, one_row, step


def test_class_contract():
    p = TOVA()
    assert p.name == "tova" and p.summary and p.paper
    assert p.query_window == 1
    # One-shot, as the authors' release: the cache is cut once the prompt has been processed.
    assert p.is_attention_mass is True and p.one_shot is True
    assert p.state_names == ("wmass",) and p.needs_every_step is False and p.accumulates_window
    assert p.options == {"recent": 0, "sinks": 0, "heads": "layer"}
    assert TOVA(recent=2, sinks=3).protected_count(50) == 5


@pytest.mark.parametrize("group", [1, 3, 7])
def test_equals_explicit_softmax_row_of_last_query(group):
    inp = make_inputs(2, group, n=11, d=16, w=1, seed=group)
    expected = group_mean(naive_rows_of(inp)[:, -1], 2)
    mass = TOVA().attention_mass(inp)
    assert mass.dtype == torch.float32 and mass.shape == (1, 2, 11)
    torch.testing.assert_close(mass[0].double(), expected, rtol=1e-5, atol=1e-7)
    # One softmax row per query head: the group mean sums to 1 per KV head.
    torch.testing.assert_close(mass.sum(dim=-1), torch.ones(1, 2))
    assert TOVA().mass_rows(inp).tolist() == [1]


def test_only_the_last_query_counts():
    """Handing over a longer window must not change the score: earlier queries are ignored."""
    wide = make_inputs(2, 3, n=10, d=8, w=4, seed=4)
    keys, values, positions, queries, qpos = (wide.keys[0], wide.values[0], wide.positions[0], wide.queries[0],
                                              wide.query_positions[0])
    last = one_row(keys, values, positions, queries[:, -1:], qpos[-1:], wide.scale, seq_len=10, num_new=1)
    torch.testing.assert_close(TOVA().scores(wide), TOVA().scores(last))
    # ... and it really is the last one, not the first: a different last query changes the scores.
    other = one_row(keys, values, positions, queries[:, :1], qpos[-1:], wide.scale, seq_len=10, num_new=1)
    assert not torch.allclose(TOVA().scores(wide), TOVA().scores(other))
    # The window is a ring buffer: the newest query is found by its position, wherever it sits.
    order = torch.tensor([2, 3, 0, 1])
    ring = one_row(keys, values, positions, queries[:, order], qpos[order], wide.scale, seq_len=10, num_new=1)
    torch.testing.assert_close(TOVA().scores(ring), TOVA().scores(last))


def test_uniform_attention_and_causality_by_hand():
    """Zero keys: the last query (at position 2) spreads 1/3 over positions 0..2; later positions get 0."""
    keys = torch.zeros(1, 5, 4)
    positions = torch.tensor([[3, 0, 4, 2, 1]])  # slots shuffled, as after compaction
    # seq_len 3: the newest query is the one at position 2 (TOVA finds it by its position).
    inp = one_row(keys, keys.clone(), positions, torch.randn(2, 1, 4), torch.tensor([2]), scale=0.5, seq_len=3,
                  num_new=1)
    torch.testing.assert_close(TOVA().attention_mass(inp), torch.tensor([[[0, 1 / 3, 0, 1 / 3, 1 / 3]]]))


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_keep_is_top_attention_with_protection(heads):
    p = EvictionConfig.from_spec("tova", 5, sinks=2, recent=1, heads=heads).build_policy()
    assert isinstance(p, TOVA)
    inp = make_inputs(3, 7, n=14, d=8, w=1, seed=9)
    r = step(p, inp, 5)
    assert r.keep.shape == (1, 3, 5) and r.state == {}
    mass = p.ranking_mass(inp)[0]
    for h in range(3):
        kept = set(r.keep[0, h].tolist())
        assert {0, 1, 13} <= kept
        free = mass[h].clone()
        free[[0, 1, 13]] = float("-inf")
        assert kept - {0, 1, 13} == set(torch.topk(free, 2).indices.tolist())


@pytest.mark.parametrize("heads", ["layer", "group"])
def test_unprotected_keep_is_plain_topk(heads):
    p = EvictionConfig.from_spec("tova", 4, heads=heads).build_policy()
    inp = make_inputs(2, 3, n=12, d=8, w=1, seed=2)
    keep = step(p, inp, 4).keep
    expected = torch.sort(torch.topk(p.ranking_mass(inp), 4, dim=-1).indices, dim=-1).values
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("group", [1, 3])
def test_layer_mode_ranks_by_the_mean_over_all_query_heads(group):
    """Default: one row per query head of the layer, averaged over all H_q of them (the paper, kvpress)."""
    inp = make_inputs(3, group, n=11, d=16, w=1, seed=5 + group)
    rows = naive_rows_of(inp)[:, -1]  # [H_q, n]
    got = TOVA().ranking_mass(inp)
    assert got.shape == (1, 3, 11) and got.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), rows.mean(dim=0).expand(3, 11), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(TOVA().scores(inp), got)  # nothing protected by default
    torch.testing.assert_close(TOVA(heads="group").ranking_mass(inp), TOVA().attention_mass(inp))


def test_layer_mode_keeps_one_set_per_layer_and_group_mode_does_not():
    inp = make_inputs(4, 2, n=30, d=8, w=1, seed=11)
    layer_keep = step(TOVA(), inp, 8).keep[0]
    assert all(torch.equal(layer_keep[h], layer_keep[0]) for h in range(4))
    group_keep = step(TOVA(heads="group"), inp, 8).keep[0]
    assert any(not torch.equal(group_keep[h], group_keep[0]) for h in range(4))
    # The group mean is still what CAOTE normalises, whichever mode TOVA ranks by.
    torch.testing.assert_close(TOVA().attention_mass(inp), TOVA(heads="group").attention_mass(inp))


def test_layer_mean_matches_by_logical_position():
    """KV heads holding different positions (in different slot orders) get the mean over all query heads
    of the attention each position receives; a head that no longer holds a position adds 0 to it; padding
    slots neither count nor get anything."""
    per_query_head = torch.tensor([[[[0.1, 0.2, 0.7, 9.0], [0.3, 0.3, 0.4, 9.0]],     # KV head 0: positions 5, 2, 9
                                    [[0.5, 0.25, 0.25, 9.0], [0.0, 0.6, 0.4, 9.0]]]])  # KV head 1: positions 9, 5, 7
    positions = torch.tensor([[[5, 2, 9, 5], [9, 5, 7, 2]]])  # the last slot is padding
    valid = torch.tensor([[[True, True, True, False]]])
    got = layer_mean(per_query_head.sum(dim=2), positions, valid, bound=10, query_heads=4)
    pos5 = (0.1 + 0.3 + 0.25 + 0.6) / 4
    pos2 = (0.2 + 0.3) / 4
    pos9 = (0.7 + 0.4 + 0.5 + 0.0) / 4
    pos7 = (0.25 + 0.4) / 4
    torch.testing.assert_close(got, torch.tensor([[[pos5, pos2, pos9, 0.0], [pos9, pos5, pos7, 0.0]]]))


def test_layer_mode_does_not_depend_on_slot_order():
    """With shuffled, per-head slot orders (as after compaction) the layer mode ranks the same tokens."""
    inp = make_inputs(2, 3, n=10, d=8, w=1, seed=3)
    perm = torch.stack([torch.randperm(10, generator=torch.Generator().manual_seed(h)) for h in range(2)])
    shuffled = one_row(torch.gather(inp.keys[0], 1, perm.unsqueeze(-1).expand(-1, -1, 8)), inp.values[0],
                       torch.gather(inp.positions[0], 1, perm), inp.queries[0], inp.query_positions[0],
                       inp.scale, seq_len=10, num_new=1)
    torch.testing.assert_close(TOVA().ranking_mass(shuffled)[0], torch.gather(TOVA().ranking_mass(inp)[0], 1, perm))


@pytest.mark.parametrize(("options", "message"), [
    ({"recent": -1}, "recent must be an integer in [0, 2147483647], got -1"),
    ({"sinks": -3}, "sinks must be an integer in [0, 2147483647], got -3"),
    ({"sinks": 2.0}, "sinks must be an integer in [0, 2147483647], got 2.0"),
    ({"recent": "1"}, "recent must be an integer in [0, 2147483647], got '1'"),
    ({"recent": None}, "recent must be an integer in [0, 2147483647], got None"),
    ({"heads": "kv"}, "heads must be one of layer, group; got 'kv'"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("tova", 64, **options)


def test_budget_must_exceed_protected():
    with pytest.raises(ValueError, match=re.escape(
            "budget 3 must be larger than the 3 tokens tova always keeps (sinks 3 + recent 0)")):
        EvictionConfig.from_spec("tova", 3, sinks=3)


def test_group_masses_per_query_head():
    """The per-query-head rows (for CAOTE's head mode) are the explicit softmax rows, and their mean is the mass."""
    inp = make_inputs(2, 3, n=9, d=8, w=2, seed=6)
    rows = naive_rows_of(inp)[:, -1]
    per_head = TOVA().group_masses(inp)
    assert per_head.shape == (1, 2, 3, 9)
    torch.testing.assert_close(per_head[0].double(), rows.view(2, 3, 9), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(per_head.mean(dim=2), TOVA().attention_mass(inp))


def test_the_layer_mean_needs_the_host_bound_on_positions():
    """The layer mode matches heads by position up to ``seq_len_bound``, a host int the caller sets
    (``max_seq_len``); unset, it is refused, not read from the device's ``seq_len`` (a synchronisation)."""
    inp = make_inputs(2, 3, n=10, d=8, w=1, seed=3)
    assert inp.seq_len_bound == 10 and TOVA().ranking_mass(inp).shape == (1, 2, 10)
    with pytest.raises(ValueError, match=r"EvictionInputs.max_seq_len must be set \(the largest seq_len, a host "
                                         r"int\).*not read from seq_len"):
        TOVA().ranking_mass(inp.evolve(max_seq_len=0))
    assert TOVA(heads="group").ranking_mass(inp.evolve(max_seq_len=0)).shape == (1, 2, 10)  # needs no bound
