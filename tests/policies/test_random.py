"""Random eviction: reproducible uniform scores, fresh per (seed, layer, step), different per head.

The batch-level properties of the draws (independent of the batch, the slot order and the device,
keyed by the global head) are in test_batched.py."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.random_policy import RandomPolicy

from .helpers import make_inputs, step


def test_class_contract():
    p = RandomPolicy()
    assert p.name == "random" and p.summary and p.paper
    assert p.options == {"sinks": 0, "recent": 0}
    assert p.query_window == 0 and p.state_names == ()
    assert p.is_attention_mass is False and p.one_shot is False
    assert RandomPolicy(sinks=1, recent=2).protected_count(10) == 3


def test_same_seed_same_keep():
    p = EvictionConfig.from_spec("random", 10).build_policy()
    assert isinstance(p, RandomPolicy)
    a = step(p, make_inputs(2, 3, n=40, d=8, w=0, seed=11), 10).keep
    b = step(RandomPolicy(), make_inputs(2, 3, n=40, d=8, w=0, seed=11), 10).keep
    assert torch.equal(a, b)


def test_independent_of_the_tensors():
    """Only (seed, layer, step) drive the draw: other keys give the same survivors."""
    inp = make_inputs(2, 1, n=30, d=8, w=0, seed=5)
    other = inp.evolve(keys=torch.randn_like(inp.keys), values=torch.randn_like(inp.values))
    assert torch.equal(RandomPolicy().scores(inp), RandomPolicy().scores(other))


@pytest.mark.parametrize("change", [{"seed": torch.tensor([1])}, {"layer": 3}, {"seq_len": torch.tensor([41])},
                                    {"head_offset": 2}])
def test_seed_layer_step_and_head_change_the_draw(change):
    inp = make_inputs(2, 1, n=40, d=8, w=0, seed=0)
    p = RandomPolicy()
    keep, other = step(p, inp, 10).keep, step(p, inp.evolve(**change), 10).keep
    for h in range(2):  # every head draws afresh
        assert not torch.equal(keep[0, h], other[0, h])


def test_each_head_draws_its_own():
    keep = step(RandomPolicy(), make_inputs(4, 1, n=40, d=8, w=0, seed=2), 10).keep
    rows = {tuple(r) for r in keep[0].tolist()}
    assert len(rows) == 4


def test_scores_are_uniform_in_unit_interval():
    s = RandomPolicy().scores(make_inputs(8, 1, n=500, d=4, w=0, seed=3))
    assert s.dtype == torch.float32 and s.shape == (1, 8, 500)
    assert (s > 0).all() and (s < 1).all()
    # Mean of 4000 uniforms: 0.5 +- 0.0046 (1 sigma); 5 sigma is a safe bound.
    assert abs(s.mean().item() - 0.5) < 0.025


def test_every_slot_equally_likely():
    """Over many seeds each slot survives with probability budget/n (here 0.25): 4000 copies of one request
    that differ only in their seed, as one batch."""
    one = make_inputs(1, 1, n=8, d=2, w=0)
    rows = lambda x: x.expand(4000, *x.shape[1:])  # noqa: E731
    inp = one.evolve(keys=rows(one.keys), values=rows(one.values), positions=rows(one.positions),
                     lengths=rows(one.lengths), queries=rows(one.queries), query_positions=rows(one.query_positions),
                     seq_len=rows(one.seq_len), num_new=rows(one.num_new), seed=torch.arange(4000))
    keep = step(RandomPolicy(), inp, 2).keep[:, 0]  # [4000, 2]
    freq = torch.bincount(keep.flatten(), minlength=8).float() / 4000
    # Binomial(4000, 0.25): sd of the frequency 0.0068; 5 sd bound.
    assert (freq - 0.25).abs().max().item() < 0.035
    # ... and the pairs are spread too: all 28 pairs occur, none much more than 1/28 of the time.
    pairs = torch.bincount(keep[:, 0] * 8 + keep[:, 1], minlength=64).float() / 4000
    assert (pairs > 0).sum() == 28 and pairs.max() < 2 / 28


def test_protection():
    p = EvictionConfig.from_spec("random", 6, sinks=2, recent=3).build_policy()
    for seed in range(10):
        keep = step(p, make_inputs(3, 1, n=30, d=4, w=0, seed=seed), 6).keep
        for h in range(3):
            assert {0, 1, 27, 28, 29} <= set(keep[0, h].tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_and_gpu_agree():
    inp = make_inputs(2, 1, n=64, d=8, w=0, seed=4)
    gpu = inp.evolve(keys=inp.keys.cuda(), values=inp.values.cuda(), positions=inp.positions.cuda(),
                     lengths=inp.lengths.cuda(), seq_len=inp.seq_len.cuda(), num_new=inp.num_new.cuda(),
                     seed=inp.seed.cuda(), queries=inp.queries.cuda(), query_positions=inp.query_positions.cuda())
    assert torch.equal(step(RandomPolicy(), inp, 16).keep, step(RandomPolicy(), gpu, 16).keep.cpu())


@pytest.mark.parametrize(("options", "message"), [
    ({"sinks": -1}, "sinks must be an integer in [0, 2147483647], got -1"),
    ({"recent": -5}, "recent must be an integer in [0, 2147483647], got -5"),
    ({"recent": "2"}, "recent must be an integer in [0, 2147483647], got '2'"),
    ({"sinks": False}, "sinks must be an integer in [0, 2147483647], got False"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("random", 64, **options)
