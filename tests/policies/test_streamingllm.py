"""StreamingLLM / Sink: the first `sinks` tokens plus the most recent budget − sinks (caote.md §8)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs
from vllm_evict.policies.streamingllm import StreamingLLM

from .helpers import compact, make_inputs, one_row, step


def inputs_at(positions: torch.Tensor, d: int = 4) -> EvictionInputs:
    h, n = positions.shape
    keys = torch.randn(h, n, d, generator=torch.Generator().manual_seed(n))
    return one_row(keys, keys.clone(), positions, torch.zeros(h, 0, d), torch.zeros(0, dtype=torch.int64),
                   scale=d ** -0.5, seq_len=int(positions.max()) + 1, num_new=1)


def test_class_contract():
    p = StreamingLLM()
    assert p.name == "streamingllm" and p.summary and p.paper
    assert p.options == {"sinks": 4} and p.sinks == 4
    assert p.query_window == 0
    assert p.is_attention_mass is False and p.one_shot is False and p.state_names == ()
    assert p.protected_count(100) == 4
    assert StreamingLLM(sinks=0).protected_count(100) == 0


def test_keeps_first_sinks_and_last_recent():
    p = EvictionConfig.from_spec("streamingllm", 8).build_policy()
    assert isinstance(p, StreamingLLM)
    inp = make_inputs(2, 3, n=20, d=8, w=0)
    keep = step(p, inp, 8).keep
    expected = torch.tensor([0, 1, 2, 3, 16, 17, 18, 19]).expand(1, 2, 8)
    assert torch.equal(keep, expected)


def test_no_sinks_is_a_sliding_window():
    p = EvictionConfig.from_spec("streamingllm", 5, sinks=0).build_policy()
    keep = step(p, make_inputs(1, 1, n=9, d=4, w=0), 5).keep
    assert keep.tolist() == [[[4, 5, 6, 7, 8]]]


def test_follows_logical_positions_not_slots():
    """Shuffled slots (different per head) and gaps left by earlier evictions."""
    positions = torch.tensor([[50, 2, 0, 51, 1, 9, 3, 30, 52],
                              [1, 52, 3, 0, 30, 2, 50, 51, 9]])
    keep = step(StreamingLLM(sinks=3), inputs_at(positions), 6).keep[0]
    kept_positions = compact(positions, keep)
    for h in range(2):
        assert sorted(kept_positions[h].tolist()) == [0, 1, 2, 50, 51, 52]
        assert keep[h].tolist() == sorted(keep[h].tolist())


def test_far_positions_stay_exact():
    """Positions beyond 2^24 collide in fp32; the ranking must still take exactly the newest."""
    base = 2 ** 30
    positions = torch.cat([torch.arange(4), base + torch.arange(12)]).view(1, -1)
    keep = step(StreamingLLM(), inputs_at(positions), 7).keep
    assert keep.tolist() == [[[0, 1, 2, 3, 13, 14, 15]]]


def test_repeated_decode_steps_keep_sinks_and_window():
    """Evict one token per decode step for a while: the cache is always sinks + the newest tokens."""
    p = StreamingLLM(sinks=2)
    positions = torch.arange(6).view(1, 6)
    for new in range(6, 20):
        positions = torch.cat([positions, torch.tensor([[new]])], dim=1)
        keep = step(p, inputs_at(positions), 6).keep[0]
        positions = compact(positions, keep)
        assert positions.tolist() == [[0, 1] + list(range(new - 3, new + 1))]


def test_scores_protect_sinks():
    s = StreamingLLM(sinks=2).scores(make_inputs(1, 1, n=6, d=4, w=0))[0]
    assert torch.isinf(s[0, :2]).all()
    assert s[0, 2:].tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(("options", "message"), [
    ({"sinks": -1}, "sinks must be an integer in [0, 2147483647], got -1"),
    ({"sinks": "4"}, "sinks must be an integer in [0, 2147483647], got '4'"),
    ({"sinks": 4.0}, "sinks must be an integer in [0, 2147483647], got 4.0"),
    ({"sinks": None}, "sinks must be an integer in [0, 2147483647], got None"),
    ({"recent": 3}, "unknown option 'recent' for streamingllm; valid options: budget, mode, policy, schedule, "
                    "seed, sinks, slack"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("streamingllm", 64, **options)


def test_budget_must_exceed_sinks():
    with pytest.raises(ValueError, match=re.escape(
            "budget 4 must be larger than the 4 tokens streamingllm always keeps (sinks 4)")):
        EvictionConfig.from_spec("streamingllm", 4)
