"""SnapKV's own ranking (window columns dropped, each query head pooled, then the group mean) against the
formula written out in float64; the whole-axis ``attention_mass`` is CAOTE's and is tested in test_caote.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.snapkv import SnapKV

from .helpers import make_inputs, naive_attention_rows


def explicit_ranking(inp, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """criticalkv.md §2.5 steps 2-5 as a sum over the window rows: [H_kv, n - window] for the prefix."""
    h_kv, n = inp.positions.shape
    rows = naive_attention_rows(inp.keys, inp.positions, inp.queries, inp.query_positions, inp.scale)
    prefix = rows[:, :, :n - window].sum(dim=1).unsqueeze(1)  # [H_q, 1, n - window]
    if pooling == "avg":
        prefix = F.avg_pool1d(prefix, kernel, stride=1, padding=kernel // 2)
    elif pooling == "max":
        prefix = F.max_pool1d(prefix, kernel, stride=1, padding=kernel // 2)
    return prefix.squeeze(1).view(h_kv, -1, n - window).mean(dim=1)


@pytest.mark.parametrize("pooling", ["avg", "max", "none"])
def test_ranking_is_pooled_per_query_head_without_the_window(pooling):
    inp = make_inputs(h_kv=2, group=3, n=36, d=8, w=6, seed=21)
    policy = SnapKV(window=6, kernel=5, pooling=pooling)
    got = policy.ranking_mass(inp)
    torch.testing.assert_close(got[:, :30].double(), explicit_ranking(inp, 6, 5, pooling), rtol=1e-5, atol=1e-7)
    scores = policy.scores(inp)
    assert bool(torch.isinf(scores[:, 30:]).all())
    torch.testing.assert_close(scores[:, :30], got[:, :30])


def test_max_pooling_per_query_head_is_not_pooling_the_group_mean():
    """The order matters for max pooling (it would not for average pooling): the reference pools each
    query head, then averages the group."""
    inp = make_inputs(h_kv=1, group=4, n=40, d=8, w=8, seed=2)
    policy = SnapKV(window=8, kernel=7, pooling="max")
    per_head_first = policy.ranking_mass(inp)[:, :32]
    group_first = F.max_pool1d(explicit_ranking(inp, 8, 1, "none").unsqueeze(1).float(), 7, 1, 3).squeeze(1)
    assert not torch.allclose(per_head_first, group_first)


def test_keep_is_the_window_plus_the_top_of_the_ranking():
    policy = EvictionConfig.from_spec("snapkv", 20, window=8).build_policy()
    inp = make_inputs(h_kv=3, group=2, n=50, d=8, w=8, seed=4)
    keep = policy.step(inp, 20).keep
    ranking = policy.ranking_mass(inp)
    for h in range(3):
        top = torch.topk(ranking[h, :42], 12).indices.tolist()
        assert keep[h].tolist() == sorted(top + list(range(42, 50)))
