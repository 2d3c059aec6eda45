"""SnapKV: window attention (GQA group mean), pooled along the logical token order; the window is kept."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.snapkv import SnapKV

from .helpers import group_mean, make_inputs, naive_rows_of, one_row, step, with_budget


def sparse_inputs(group: int, seed: int, n: int = 40, window: int = 6, shuffle: bool = True):
    """One request after earlier evictions: old tokens at every third position, the last ``window``
    positions dense (the window's queries), slots shuffled per head as compaction may leave them."""
    base = make_inputs(2, group, n, 8, window, seed=seed)
    old = n - window
    pos = torch.cat([torch.arange(old) * 3, torch.arange(window) + 3 * old]).expand(2, n).clone()
    if shuffle:
        gen = torch.Generator().manual_seed(seed)
        for h in range(2):
            pos[h] = pos[h][torch.randperm(n, generator=gen)]
    last = 3 * old + window - 1
    return one_row(base.keys[0], base.values[0], pos, base.queries[0], torch.arange(last - window + 1, last + 1),
                   base.scale, seq_len=last + 1, num_new=window)


def naive_pool(x: torch.Tensor, positions: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    """Pool [H, n] along each head's logical order: 'same' size, zero padding at both ends; avg divides by
    the full kernel, max takes the max of the in-row neighbours."""
    if kind == "none":
        return x.clone()
    h, n = x.shape
    out = torch.empty_like(x)
    for head in range(h):
        order = sorted(range(n), key=lambda j: int(positions[head, j]))
        for t, j in enumerate(order):
            window = [x[head, order[u]] for u in range(max(0, t - kernel // 2), min(n, t + kernel // 2 + 1))]
            out[head, j] = sum(window) / kernel if kind == "avg" else max(window)
    return out


def naive_window_mass(inp) -> torch.Tensor:
    """Group mean of the window queries' causal softmax rows, summed over the window: [H, n] float64."""
    return group_mean(naive_rows_of(inp).sum(dim=1), inp.num_kv_heads)


def naive_scores(inp, window: int, kernel: int, pooling: str, sinks: int = 0) -> torch.Tensor:
    positions = inp.positions[0]
    in_window = positions > positions.max(dim=-1, keepdim=True).values - window
    raw = naive_window_mass(inp).masked_fill(in_window, 0.0)
    pooled = naive_pool(raw, positions, kernel, pooling)
    return pooled.masked_fill(in_window | (positions < sinks), float("inf"))


def top_set(score: torch.Tensor, budget: int) -> list[int]:
    """The ``budget`` highest scores of one head (ties: lower slot), ascending."""
    order = sorted(range(score.shape[0]), key=lambda j: (-float(score[j]), j))
    return sorted(order[:budget])


def test_class_contract():
    p = SnapKV()
    assert p.name == "snapkv" and p.summary and p.paper
    assert p.options == {"window": 32, "kernel": 7, "pooling": "avg", "sinks": 0}
    assert p.query_window == 32 and p.one_shot and p.is_attention_mass
    assert p.state_names == () and p.computed_state == () and not p.needs_every_step
    assert SnapKV(window=8, sinks=2).protected_count(100) == 10
    assert EvictionConfig.from_spec("snapkv", 64).schedule == "oneshot"


@pytest.mark.parametrize("pooling,kernel", [("avg", 7), ("avg", 3), ("none", 7)])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_scores_and_keep_equal_the_naive_formula(group, pooling, kernel):
    inp = sparse_inputs(group, seed=group + kernel)
    p = SnapKV(window=6, kernel=kernel, pooling=pooling, sinks=2)
    expected = naive_scores(inp, 6, kernel, pooling, sinks=2)
    got = p.scores(inp)[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-7)
    keep = step(p, inp, 15).keep[0]
    for h in range(2):
        assert keep[h].tolist() == top_set(expected[h], 15)
        kept_positions = set(inp.positions[0, h, keep[h]].tolist())
        assert set(range(int(inp.seq_len[0]) - 6, int(inp.seq_len[0]))) | {0} <= kept_positions  # window + sink


def test_window_is_not_scored_only_kept():
    """Zeroing the window's columns before pooling: the tokens just before the window get none of the
    window's attention to itself (its own columns are large: every window query sees them)."""
    inp = sparse_inputs(3, seed=5, shuffle=False)
    p = SnapKV(window=6, kernel=7)
    mass = p.window_mass(inp)[0].double()
    torch.testing.assert_close(mass, naive_window_mass(inp), rtol=1e-5, atol=1e-7)
    scores = p.scores(inp)[0]
    assert torch.isposinf(scores[:, -6:]).all()
    # The 3 tokens before the window would average in window columns under kernel 7; they must not.
    torch.testing.assert_close(scores[:, -9:-6].double(), naive_pool(mass.masked_fill(
        torch.arange(40) >= 34, 0.0), inp.positions[0], 7, "avg")[:, -9:-6], rtol=1e-5, atol=1e-7)


def test_attention_mass_pools_the_whole_axis():
    """CAOTE's mass: pooled over every candidate, window included, finite everywhere."""
    inp = sparse_inputs(3, seed=6)
    p = SnapKV(window=6, kernel=5)
    mass = p.attention_mass(inp)[0]
    expected = naive_pool(naive_window_mass(inp), inp.positions[0], 5, "avg")
    torch.testing.assert_close(mass.double(), expected, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(mass).all() and (mass >= 0).all()
    # avg pooling divides by the full kernel, so the total shrinks only at the row's two ends
    assert float(mass.sum()) <= float(naive_window_mass(inp).sum()) + 1e-4


def test_group_masses_per_query_head():
    inp = sparse_inputs(3, seed=7)
    p = SnapKV(window=6, kernel=5)
    per_head = p.group_masses(inp)
    assert per_head.shape == (1, 2, 3, 40)
    rows = naive_rows_of(inp).sum(dim=1).view(2, 3, 40)  # [H_kv, G, n] window column sums
    for g in range(3):
        torch.testing.assert_close(per_head[0, :, g].double(), naive_pool(rows[:, g], inp.positions[0], 5, "avg"),
                                   rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(per_head.mean(dim=2), p.attention_mass(inp))  # average pooling is linear


def test_max_pooling_dominates_the_unpooled_mass():
    """Max pooling (the paper's CriticalKV setting): the window is kept, and every other score is at least
    the token's own window mass (whichever order pooling and the group mean take)."""
    inp = sparse_inputs(3, seed=8)
    p = SnapKV(window=6, kernel=7, pooling="max")
    scores = p.scores(inp)[0].double()
    raw = naive_window_mass(inp)
    outside = ~torch.isinf(scores)
    assert outside.sum() == 2 * 34
    assert (scores[outside] >= raw[outside] - 1e-6).all()
    keep = step(p, inp, 12).keep[0]
    for h in range(2):
        assert keep[h].tolist() == top_set(scores[h], 12)


def test_short_window_and_mass_rows():
    """Fewer queries than the window (a short prompt): the mass adds up the queries there are."""
    inp = make_inputs(2, 3, 10, 8, 4, seed=9)
    p = SnapKV(window=8)
    assert p.mass_rows(inp).tolist() == [4]
    torch.testing.assert_close(p.window_mass(inp).sum(dim=-1), torch.full((1, 2), 4.0))
    assert p.mass_rows(inp.evolve(query_positions=torch.tensor([[-1, -1, 8, 9]]))).tolist() == [2]
    batch = with_budget(inp, 9)
    assert p.protected_mask(batch)[0, :, 2:].all() and not p.protected_mask(batch)[0, :, :2].any()


@pytest.mark.parametrize(("options", "message"), [
    ({"window": 0}, "window must be an integer in [1, 2147483647], got 0"),
    ({"window": 2.5}, "window must be an integer in [1, 2147483647], got 2.5"),
    ({"kernel": 4}, "kernel must be an odd integer in [1, 31] (pooling keeps the length), got 4"),
    ({"kernel": 0}, "kernel must be an odd integer in [1, 31] (pooling keeps the length), got 0"),
    ({"pooling": "mean"}, "pooling must be one of avg, max, none; got 'mean'"),
    ({"sinks": -1}, "sinks must be an integer in [0, 2147483647], got -1"),
    ({"recent": 4}, "unknown option 'recent' for snapkv"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("snapkv", 64, **options)


def test_budget_must_exceed_protected():
    with pytest.raises(ValueError, match=re.escape(
            "budget 10 must be larger than the 10 tokens snapkv always keeps (sinks 2 + window 8)")):
        EvictionConfig.from_spec("snapkv", 10, window=8, sinks=2)


# ---- SnapKV's own ranking, against the reference formula (criticalkv.md §2.5) ---------------------------
def explicit_ranking(inp, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """criticalkv.md §2.5 steps 2-5 as a sum over the window rows: [H_kv, n - window] for the prefix of
    a 1-row batch with slot = position."""
    h_kv, n = inp.positions.shape[1:]
    rows = naive_rows_of(inp)
    prefix = rows[:, :, :n - window].sum(dim=1).unsqueeze(1)  # [H_q, 1, n - window]
    if pooling == "avg":
        prefix = torch.nn.functional.avg_pool1d(prefix, kernel, stride=1, padding=kernel // 2)
    elif pooling == "max":
        prefix = torch.nn.functional.max_pool1d(prefix, kernel, stride=1, padding=kernel // 2)
    return prefix.squeeze(1).view(h_kv, -1, n - window).mean(dim=1)


@pytest.mark.parametrize("pooling", ["avg", "max", "none"])
def test_ranking_is_pooled_per_query_head_without_the_window(pooling):
    inp = make_inputs(h_kv=2, group=3, n=36, d=8, w=6, seed=21)
    policy = SnapKV(window=6, kernel=5, pooling=pooling)
    got = policy.ranking_mass(inp)[0]
    torch.testing.assert_close(got[:, :30].double(), explicit_ranking(inp, 6, 5, pooling), rtol=1e-5, atol=1e-7)
    scores = policy.scores(inp)[0]
    assert bool(torch.isinf(scores[:, 30:]).all())
    torch.testing.assert_close(scores[:, :30], got[:, :30])


def test_max_pooling_per_query_head_is_not_pooling_the_group_mean():
    """The order matters for max pooling (it would not for average pooling): the reference pools each
    query head, then averages the group."""
    inp = make_inputs(h_kv=1, group=4, n=40, d=8, w=8, seed=2)
    policy = SnapKV(window=8, kernel=7, pooling="max")
    per_head_first = policy.ranking_mass(inp)[0, :, :32]
    group_first = torch.nn.functional.max_pool1d(explicit_ranking(inp, 8, 1, "none").unsqueeze(1).float(),
                                                 7, 1, 3).squeeze(1)
    assert not torch.allclose(per_head_first, group_first)
