"""Random eviction: reproducible uniform scores, fresh per (seed, layer, step), different per head."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.random_policy import RandomPolicy

from .helpers import make_inputs


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
    a = p.step(make_inputs(2, 3, n=40, d=8, w=0, seed=11), budget=10).keep
    b = RandomPolicy().step(make_inputs(2, 3, n=40, d=8, w=0, seed=11), budget=10).keep
    assert torch.equal(a, b)


def test_independent_of_the_tensors():
    """Only (seed, layer, step) drive the draw: other keys give the same survivors."""
    inp = make_inputs(2, 1, n=30, d=8, w=0, seed=5)
    other = dataclasses.replace(inp, keys=torch.randn_like(inp.keys))
    assert torch.equal(RandomPolicy().scores(inp), RandomPolicy().scores(other))


@pytest.mark.parametrize("change", [{"seed": 1}, {"layer": 3}, {"seq_len": 41}])
def test_seed_layer_and_step_change_the_draw(change):
    inp = make_inputs(2, 1, n=40, d=8, w=0, seed=0)
    p = RandomPolicy()
    assert not torch.equal(p.step(inp, 10).keep, p.step(dataclasses.replace(inp, **change), 10).keep)


def test_each_head_draws_its_own():
    keep = RandomPolicy().step(make_inputs(4, 1, n=40, d=8, w=0, seed=2), budget=10).keep
    rows = {tuple(r) for r in keep.tolist()}
    assert len(rows) == 4


def test_scores_are_uniform_in_unit_interval():
    s = RandomPolicy().scores(make_inputs(8, 1, n=500, d=4, w=0, seed=3))
    assert s.dtype == torch.float32 and s.shape == (8, 500)
    assert (s >= 0).all() and (s < 1).all()
    # Mean of 4000 uniforms: 0.5 +- 0.0046 (1 sigma); 5 sigma is a safe bound.
    assert abs(s.mean().item() - 0.5) < 0.025


def test_every_slot_equally_likely():
    """Over many seeds each slot survives with probability budget/n (here 0.25)."""
    counts = torch.zeros(8)
    p = RandomPolicy()
    for seed in range(400):
        keep = p.step(make_inputs(1, 1, n=8, d=2, w=0, seed=seed), budget=2).keep
        counts[keep[0]] += 1
    freq = counts / 400
    # Binomial(400, 0.25): sd of the frequency 0.0217; 5 sd bound.
    assert (freq - 0.25).abs().max().item() < 0.11


def test_protection():
    p = EvictionConfig.from_spec("random", 6, sinks=2, recent=3).build_policy()
    for seed in range(10):
        keep = p.step(make_inputs(3, 1, n=30, d=4, w=0, seed=seed), budget=6).keep
        for h in range(3):
            assert {0, 1, 27, 28, 29} <= set(keep[h].tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_and_gpu_agree():
    inp = make_inputs(2, 1, n=64, d=8, w=0, seed=4)
    gpu = dataclasses.replace(inp, keys=inp.keys.cuda(), values=inp.values.cuda(), positions=inp.positions.cuda())
    assert torch.equal(RandomPolicy().step(inp, 16).keep, RandomPolicy().step(gpu, 16).keep.cpu())


@pytest.mark.parametrize(("options", "message"), [
    ({"sinks": -1}, "sinks must be an integer >= 0, got -1"),
    ({"recent": -5}, "recent must be an integer >= 0, got -5"),
    ({"recent": "2"}, "recent must be an integer >= 0, got '2'"),
    ({"sinks": False}, "sinks must be an integer >= 0, got False"),
])
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EvictionConfig.from_spec("random", 64, **options)
