"""KeyDiff: keep the keys least similar to the mean normalised key (keydiff.md §3.2, §3.5, §3.6)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs
from vllm_evict.policies.keydiff import KeyDiff

from .helpers import make_inputs, one_row, step


def keys_only(keys: torch.Tensor) -> EvictionInputs:
    h, n, d = keys.shape
    return one_row(keys, torch.zeros_like(keys), torch.arange(n).expand(h, n), torch.zeros(h, 0, d, dtype=keys.dtype),
                   torch.zeros(0, dtype=torch.int64), scale=1.0, seq_len=n, num_new=1)


def pairwise_scores(keys: torch.Tensor) -> torch.Tensor:
    """The pairwise form (Eq. 7), −Σ_j cos(k_i, k_j) per head, in float64: [H, n] (O(n²·d))."""
    khat = F.normalize(keys.double(), dim=-1)
    return -(khat @ khat.transpose(-1, -2)).sum(dim=-1)


def test_class_contract():
    p = KeyDiff()
    assert p.name == "keydiff" and p.summary and p.paper
    assert p.options == {"recent": 0, "sinks": 0}
    assert p.query_window == 0 and p.state_names == ()
    assert p.is_attention_mass is False and p.one_shot is False
    assert p.protected_count(100) == 0
    assert KeyDiff(recent=3, sinks=1).protected_count(100) == 4


def test_hand_example_2d():
    """k̂ = (1,0), (1,0), (0,1), (1,0), (-1,0); μ = (0.4, 0.2); k̂ᵀμ = 0.4, 0.4, 0.2, 0.4, -0.4."""
    keys = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.5, 0.0], [-1.0, 0.0]]])
    p = EvictionConfig.from_spec("keydiff", 2).build_policy()
    assert isinstance(p, KeyDiff)
    inp = keys_only(keys)
    torch.testing.assert_close(p.scores(inp), torch.tensor([[[-0.4, -0.4, -0.2, -0.4, 0.4]]]))
    # The two odd ones out survive: the opposite key (4) and the orthogonal one (2).
    assert step(p, inp, 2).keep.tolist() == [[[2, 4]]]
    # A third place goes to one of the three identical directions: the lowest slot wins the tie.
    assert step(p, inp, 3).keep.tolist() == [[[0, 2, 4]]]


def test_anchor_ranking_equals_pairwise_ranking():
    keys = torch.randn(3, 60, 16, generator=torch.Generator().manual_seed(0)) + 0.5  # a shared direction
    anchor = KeyDiff().scores(keys_only(keys))[0]
    pairwise = pairwise_scores(keys)
    assert torch.equal(torch.argsort(anchor, dim=-1), torch.argsort(pairwise, dim=-1))
    # Σ_j k̂_iᵀk̂_j = n·k̂_iᵀμ: the forms agree exactly up to the factor n.
    torch.testing.assert_close(pairwise, 60 * anchor.double(), rtol=1e-4, atol=1e-4)
    for budget in (1, 10, 59):
        assert torch.equal(step(KeyDiff(), keys_only(keys), budget).keep[0],
                           torch.sort(torch.topk(pairwise, budget, dim=-1).indices, dim=-1).values)


def test_pairwise_scores_by_hand():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 5.0], [-2.0, 0.0]]])
    # cos matrix rows: [1, 0, -1], [0, 1, 0], [-1, 0, 1] -> row sums 0, 1, 0; the anchor form is 1/n of it.
    torch.testing.assert_close(pairwise_scores(keys), torch.tensor([[0.0, -1.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(KeyDiff().scores(keys_only(keys)), torch.tensor([[[0.0, -1 / 3, 0.0]]]))


def test_score_is_minus_cosine_times_anchor_norm():
    keys = torch.randn(2, 25, 8, generator=torch.Generator().manual_seed(3))
    khat = F.normalize(keys, dim=-1)
    mu = khat.mean(dim=1, keepdim=True)
    cos = F.cosine_similarity(keys, mu, dim=-1)
    torch.testing.assert_close(KeyDiff().scores(keys_only(keys))[0], -cos * mu.norm(dim=-1), rtol=1e-5, atol=1e-6)


def test_key_norms_do_not_matter():
    keys = torch.randn(2, 30, 8, generator=torch.Generator().manual_seed(5))
    scale = torch.rand(2, 30, 1, generator=torch.Generator().manual_seed(6)) * 100 + 0.01
    torch.testing.assert_close(KeyDiff().scores(keys_only(keys)), KeyDiff().scores(keys_only(keys * scale)))


def test_zero_key_is_finite():
    keys = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]])
    s = KeyDiff().scores(keys_only(keys))
    assert torch.isfinite(s).all()
    assert s[0, 0, 0].item() == 0.0  # k̂ = 0 under the eps floor


def test_half_precision_keys_score_in_fp32():
    keys = torch.randn(2, 12, 8).half()
    s = KeyDiff().scores(keys_only(keys))
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, KeyDiff().scores(keys_only(keys.float())))


@pytest.mark.parametrize("group", [1, 3, 7])
def test_per_kv_head_and_no_queries(group):
    """Each KV head is ranked on its own keys; the queries (any group size) play no part."""
    inp = make_inputs(3, group, n=20, d=8, w=5, seed=1)
    keep = step(KeyDiff(), inp, 7).keep
    for h in range(3):
        alone = step(KeyDiff(), keys_only(inp.keys[0, h:h + 1]), 7).keep
        assert torch.equal(keep[:, h:h + 1], alone)


def test_recent_ablation_keeps_anchor_over_all():
    p = EvictionConfig.from_spec("keydiff", 8, recent=3).build_policy()
    inp = make_inputs(2, 1, n=20, d=8, w=0, seed=2)
    plain = KeyDiff().scores(inp)[0]
    s = p.scores(inp)[0]
    assert torch.isinf(s[:, 17:]).all()
    torch.testing.assert_close(s[:, :17], plain[:, :17])  # the anchor still covers the protected tokens
    keep = step(p, inp, 8).keep[0]
    free = plain[:, :17]
    expected_rest = torch.sort(torch.topk(free, 5, dim=-1).indices, dim=-1).values
    assert torch.equal(keep[:, :5], expected_rest) and keep[:, 5:].tolist() == [[17, 18, 19]] * 2


@pytest.mark.parametrize(("options", "message"), [
    ({"recent": -1}, "recent must be an integer in [0, 2147483647], got -1"),
    ({"sinks": -1}, "sinks must be an integer in [0, 2147483647], got -1"),
    ({"recent": 0.1}, "recent must be an integer in [0, 2147483647], got 0.1"),
    ({"sinks": "0"}, "sinks must be an integer in [0, 2147483647], got '0'"),
    ({"anchor": "median"}, "unknown option 'anchor' for keydiff; valid options: budget, mode, policy, recent, "
                           "schedule, seed, sinks, slack"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("keydiff", 64, **options)


def test_budget_must_exceed_protected():
    with pytest.raises(ValueError, match=re.escape(
            "budget 10 must be larger than the 10 tokens keydiff always keeps (sinks 0 + recent 10)")):
        EvictionConfig.from_spec("keydiff", 10, recent=10)
