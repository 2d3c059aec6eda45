"""KeyL2Norm: keep the keys with the smallest L2 norm, score −||k|| per KV head (keydiff.md §8)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs
from vllm_evict.policies.knorm import KeyNorm

from .helpers import make_inputs, one_row, step


def keys_only(keys: torch.Tensor) -> EvictionInputs:
    h, n, d = keys.shape
    return one_row(keys, torch.zeros_like(keys), torch.arange(n).expand(h, n), torch.zeros(h, 0, d, dtype=keys.dtype),
                   torch.zeros(0, dtype=torch.int64), scale=1.0, seq_len=n, num_new=1)


def test_class_contract():
    p = KeyNorm()
    assert p.name == "knorm" and p.summary and p.paper
    assert p.options == {"sinks": 0, "recent": 0}
    assert p.query_window == 0 and p.state_names == ()
    assert p.is_attention_mass is False and p.one_shot is False
    assert KeyNorm(sinks=4, recent=1).protected_count(10) == 5


def test_hand_example_keeps_smallest_norms():
    # Norms per head: head 0: 5, 1, 3, 0.5, 2 ; head 1: 1, 2, 3, 4, 5.
    keys = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, -3.0], [0.3, 0.4], [0.0, 2.0]],
                         [[0.0, 1.0], [-2.0, 0.0], [0.0, 3.0], [4.0, 0.0], [3.0, 4.0]]])
    p = EvictionConfig.from_spec("knorm", 3).build_policy()
    assert isinstance(p, KeyNorm)
    inp = keys_only(keys)
    torch.testing.assert_close(p.scores(inp), -torch.tensor([[[5.0, 1.0, 3.0, 0.5, 2.0],
                                                               [1.0, 2.0, 3.0, 4.0, 5.0]]]))
    assert step(p, inp, 3).keep.tolist() == [[[1, 3, 4], [0, 1, 2]]]


def test_direction_is_irrelevant_only_norm_counts():
    keys = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(0))
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
    p = KeyNorm()
    assert torch.equal(step(p, keys_only(keys), 8).keep, step(p, keys_only(keys @ rotation), 8).keep)


def test_half_precision_keys_score_in_fp32():
    keys = torch.randn(2, 10, 8).half()
    s = KeyNorm().scores(keys_only(keys))
    assert s.dtype == torch.float32
    torch.testing.assert_close(s[0], -keys.float().norm(dim=-1))


@pytest.mark.parametrize("group", [1, 3, 7])
def test_queries_do_not_matter(group):
    inp = make_inputs(2, group, n=16, d=8, w=4, seed=0)
    keep = step(KeyNorm(), inp, 6).keep
    expected = torch.sort(torch.topk(-inp.keys.norm(dim=-1), 6, dim=-1).indices, dim=-1).values
    assert torch.equal(keep, expected)


def test_protection():
    keys = torch.arange(1, 11, dtype=torch.float32).view(1, 10, 1)  # norms grow with position
    p = KeyNorm(sinks=0, recent=2)
    # Without protection the 4 smallest (positions 0..3) survive; with recent=2, 8 and 9 take two places.
    assert step(p, keys_only(keys), 4).keep.tolist() == [[[0, 1, 8, 9]]]
    assert step(KeyNorm(), keys_only(keys), 4).keep.tolist() == [[[0, 1, 2, 3]]]


@pytest.mark.parametrize(("options", "message"), [
    ({"sinks": -1}, "sinks must be an integer in [0, 2147483647], got -1"),
    ({"recent": -1}, "recent must be an integer in [0, 2147483647], got -1"),
    ({"sinks": 1.0}, "sinks must be an integer in [0, 2147483647], got 1.0"),
    ({"recent": [2]}, "recent must be an integer in [0, 2147483647], got a list of 1 entries"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("knorm", 64, **options)
