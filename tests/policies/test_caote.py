"""CAOTE / FastCAOTE: the score is the exact attention-output change of dropping one token."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.dense import protect
from vllm_evict.policies import load_class
from vllm_evict.policies.base import EvictionInputs, Policy
from vllm_evict.policies.caote import CAOTE, FastCAOTE, head_mode_bases

from .helpers import make_inputs, step, with_initial_state


class FixedMass(Policy):
    """A test base whose mass (and optionally per-query-head masses and protection) is given outright,
    for one request: mass and protection [H, n], per-head masses [H, G, n] (used as 1-row batches)."""

    name = "fixedmass"
    is_attention_mass = True

    def __init__(self, mass: torch.Tensor, protected: torch.Tensor | None = None,
                 per_head: torch.Tensor | None = None) -> None:
        super().__init__()
        self._mass = mass.unsqueeze(0)
        self._protected = None if protected is None else protected.unsqueeze(0)
        self._per_head = None if per_head is None else per_head.unsqueeze(0)

    def attention_mass(self, inp: EvictionInputs) -> torch.Tensor:
        return self._mass

    def protected_mask(self, inp: EvictionInputs) -> torch.Tensor:
        if self._protected is None:
            return super().protected_mask(inp)
        return self._protected

    def scores(self, inp: EvictionInputs) -> torch.Tensor:
        return protect(self._mass, self.protected_mask(inp))


class FixedMassPerHead(FixedMass):
    def group_masses(self, inp: EvictionInputs) -> torch.Tensor:
        return self._per_head


def softmax64(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(logits - logits.max())
    return e / e.sum()


def brute_force_errors(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """||X - X'_j|| for one query: X over all n tokens, X'_j with token j removed and softmax redone."""
    q, keys, values = q.double(), keys.double(), values.double()
    logits = scale * (keys @ q)
    x = softmax64(logits) @ values
    out = torch.empty(keys.shape[0], dtype=torch.float64)
    for j in range(keys.shape[0]):
        rest = [i for i in range(keys.shape[0]) if i != j]
        x_j = softmax64(logits[rest]) @ values[rest]
        out[j] = torch.linalg.vector_norm(x - x_j)
    return out


def single_query_inputs(n: int = 24, d: int = 16, seed: int = 0) -> EvictionInputs:
    """One KV head, one query head, one query at the newest position (it sees every key)."""
    return make_inputs(h_kv=1, group=1, n=n, d=d, w=1, seed=seed)


@pytest.mark.parametrize("spec,options", [
    ("caote+tova", {}),
    ("caote+snapkv", {"window": 1, "kernel": 1, "pooling": "none"}),
])
def test_score_is_exact_output_change_of_dropping_a_token(spec, options):
    inp = single_query_inputs()
    policy = EvictionConfig.from_spec(spec, budget=8, **options).build_policy()
    c = policy.scores(inp)[0, 0]
    expected = brute_force_errors(inp.queries[0, 0, 0], inp.keys[0, 0], inp.values[0, 0], inp.scale)
    protected = policy.protected_mask(inp)[0, 0]
    assert torch.isinf(c[protected]).all()
    torch.testing.assert_close(c[~protected].double(), expected[~protected], rtol=1e-5, atol=1e-7)
    assert c.dtype == torch.float32


def test_closed_form_matches_the_brute_force_with_a_given_distribution():
    inp = single_query_inputs(n=30, d=8, seed=3)
    logits = inp.scale * (inp.keys[0, 0].double() @ inp.queries[0, 0, 0].double())
    alpha = softmax64(logits)
    policy = CAOTE(FixedMass((alpha * 7.0).float().unsqueeze(0)))  # any positive scale: divided by the sum
    policy.check_options()
    c = policy.scores(inp)[0, 0].double()
    expected = brute_force_errors(inp.queries[0, 0, 0], inp.keys[0, 0], inp.values[0, 0], inp.scale)
    torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-7)


def test_fast_variant_uses_the_plain_mean_of_values():
    inp = make_inputs(h_kv=2, group=2, n=20, d=8, w=4, seed=1)
    mass = torch.rand(2, 20, generator=torch.Generator().manual_seed(5)) + 0.01
    fast = FastCAOTE(FixedMass(mass)).scores(inp)[0]
    full = CAOTE(FixedMass(mass)).scores(inp)[0]
    alpha = mass.double() / mass.double().sum(-1, keepdim=True)
    v = inp.values[0].double()
    expected = torch.empty(2, 20, dtype=torch.float64)
    for h in range(2):
        mean = v[h].mean(dim=0)
        for j in range(20):
            expected[h, j] = alpha[h, j] / (1 - alpha[h, j]) * torch.linalg.vector_norm(mean - v[h, j])
    torch.testing.assert_close(fast.double(), expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(fast, full)  # CAOTE uses the alpha-weighted mean instead


def test_protected_tokens_get_inf_after_alpha_and_x():
    inp = make_inputs(h_kv=1, group=1, n=12, d=4, w=1, seed=2)
    mass = torch.rand(1, 12, generator=torch.Generator().manual_seed(0)) + 0.1
    protected = torch.zeros(1, 12, dtype=torch.bool)
    protected[0, [0, 11]] = True
    c = CAOTE(FixedMass(mass, protected)).scores(inp)[0]
    unprotected = CAOTE(FixedMass(mass)).scores(inp)[0]
    assert torch.isinf(c[protected]).all() and torch.isfinite(c[~protected]).all()
    # The protected tokens still count in alpha and X: the other scores are unchanged by protection.
    torch.testing.assert_close(c[~protected], unprotected[~protected])


def test_snapkv_window_is_protected_and_budget_respected():
    inp = make_inputs(h_kv=2, group=2, n=64, d=8, w=8, seed=4)
    policy = EvictionConfig.from_spec("caote+snapkv", budget=20, window=8).build_policy()
    c = policy.scores(inp)[0]
    assert torch.isinf(c[:, -8:]).all() and torch.isfinite(c[:, :-8]).all()
    keep = step(policy, with_initial_state(policy, inp), 20).keep[0]
    assert keep.shape == (2, 20)
    assert set(range(56, 64)) <= set(keep[0].tolist()) and set(range(56, 64)) <= set(keep[1].tolist())
    for h in range(2):  # the 12 unprotected survivors are the 12 highest CAOTE scores
        expected = torch.topk(c[h, :56], 12).indices.sort().values
        assert keep[h, :12].tolist() == expected.tolist()


def test_alpha_close_to_one_gives_inf():
    inp = make_inputs(h_kv=1, group=1, n=6, d=4, w=1, seed=0)
    mass = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    c = CAOTE(FixedMass(mass)).scores(inp)[0, 0]
    assert math.isinf(c[2]) and c[2] > 0
    assert torch.equal(c[[0, 1, 3, 4, 5]], torch.zeros(5))
    # 1 - alpha = 1e-7 < eps = 1e-6: forced to +inf although the closed form would be finite.
    mass = torch.tensor([[1e-7, 0.0, 1.0 - 1e-7, 0.0, 0.0, 0.0]], dtype=torch.float32)
    c = CAOTE(FixedMass(mass)).scores(inp)[0, 0]
    assert math.isinf(c[2])
    # With a smaller eps the same token gets a finite score.
    mass = torch.tensor([[0.02, 0.0, 0.98, 0.0, 0.0, 0.0]])
    c = CAOTE(FixedMass(mass), eps=1e-6).scores(inp)[0, 0]
    v = inp.values[0, 0]
    x = 0.02 * v[0] + 0.98 * v[2]
    assert math.isfinite(c[2])
    torch.testing.assert_close(c[2], 0.98 / 0.02 * torch.linalg.vector_norm(x - v[2]), rtol=1e-4, atol=0)


def test_zero_mass_falls_back_to_uniform_alpha():
    inp = make_inputs(h_kv=2, group=1, n=10, d=4, w=1, seed=6)
    mass = torch.zeros(2, 10)
    c = CAOTE(FixedMass(mass)).scores(inp)[0]
    v = inp.values[0]
    expected = (0.1 / 0.9) * torch.linalg.vector_norm(v.mean(dim=1, keepdim=True) - v, dim=-1)
    torch.testing.assert_close(c, expected)
    # Uniform alpha makes X the plain mean, so CAOTE and FastCAOTE agree.
    torch.testing.assert_close(c, FastCAOTE(FixedMass(mass)).scores(inp)[0])
    assert torch.isfinite(c).all()


def test_head_mode_combines_per_query_head_errors_in_quadrature():
    h_kv, group, n, d = 2, 3, 16, 8
    inp = make_inputs(h_kv=h_kv, group=group, n=n, d=d, w=1, seed=7)
    keys, values, queries = inp.keys[0], inp.values[0], inp.queries[0]
    rows = torch.stack([
        softmax64(inp.scale * (keys[g // group].double() @ queries[g, 0].double()))
        for g in range(h_kv * group)
    ]).view(h_kv, group, n)
    base = FixedMassPerHead(rows.mean(dim=1).float(), per_head=rows.float())
    policy = CAOTE(base, caote_mode="head")
    policy.check_options()
    c = policy.scores(inp)[0].double()
    expected = torch.zeros(h_kv, n, dtype=torch.float64)
    for g in range(h_kv * group):
        err = brute_force_errors(queries[g, 0], keys[g // group], values[g // group], inp.scale)
        expected[g // group] += err ** 2
    torch.testing.assert_close(c, expected.sqrt(), rtol=1e-5, atol=1e-7)
    group_mode = CAOTE(base).scores(inp)[0].double()
    assert not torch.allclose(group_mode, c)


def test_head_mode_fast_uses_one_plain_mean_per_group():
    """FastCAOTE in head mode: every query head's alpha_g, but one X = mean of the values for the group."""
    h_kv, group, n = 2, 3, 12
    inp = make_inputs(h_kv=h_kv, group=group, n=n, d=4, w=1, seed=11)
    per_head = torch.rand(h_kv, group, n, generator=torch.Generator().manual_seed(2)) + 0.05
    base = FixedMassPerHead(per_head.mean(dim=1), per_head=per_head)
    policy = FastCAOTE(base, caote_mode="head")
    policy.check_options()
    c = policy.scores(inp)[0].double()
    v = inp.values[0].double()
    expected = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_kv):
        mean = v[h].mean(dim=0)
        for g in range(group):
            alpha = per_head[h, g].double() / per_head[h, g].double().sum()
            for j in range(n):
                expected[h, j] += (alpha[j] / (1 - alpha[j]) * torch.linalg.vector_norm(mean - v[h, j])) ** 2
    torch.testing.assert_close(c, expected.sqrt(), rtol=1e-5, atol=1e-7)


def test_head_mode_with_snapkv_is_consistent_with_its_mass():
    inp = make_inputs(h_kv=2, group=2, n=40, d=8, w=8, seed=8)
    policy = EvictionConfig.from_spec("caote+snapkv", budget=16, window=8, caote_mode="head").build_policy()
    per_head = policy.base.group_masses(inp)
    assert per_head.shape == (1, 2, 2, 40)
    torch.testing.assert_close(per_head.mean(dim=2), policy.base.attention_mass(inp))
    c = policy.scores(inp)[0]
    assert torch.isinf(c[:, -8:]).all() and torch.isfinite(c[:, :-8]).all()
    assert "snapkv" in head_mode_bases() and "tova" in head_mode_bases()


def test_head_mode_rejected_for_bases_without_per_head_mass():
    with pytest.raises(ValueError, match=r"caote_mode 'head' needs .*h2o.*snapkv"):
        EvictionConfig.from_spec("caote+h2o", budget=64, caote_mode="head")
    with pytest.raises(ValueError, match="caote_mode 'head'"):
        CAOTE(FixedMass(torch.ones(1, 4)), caote_mode="head").check_options()


@pytest.mark.parametrize("options,message", [
    ({"caote_mode": "query"}, "caote_mode must be one of group, head"),
    ({"eps": 0.0}, r"eps must be a number in \(0, 1\), got 0.0"),
    ({"eps": 1.0}, r"eps must be a number in \(0, 1\), got 1.0"),
    ({"eps": "small"}, r"eps must be a number in \(0, 1\), got \'small\'"),
])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig.from_spec("fastcaote+snapkv", budget=64, **options)


def test_registry_and_delegation_to_the_base():
    assert load_class("caote") is CAOTE and load_class("fastcaote") is FastCAOTE
    policy = EvictionConfig.from_spec("caote+h2o", budget=64).build_policy()
    assert policy.name == "caote" and policy.base.name == "h2o"
    assert policy.state_names == ("acc",) and policy.needs_every_step and policy.query_window is None
    inp = make_inputs(h_kv=1, group=2, n=12, d=4, w=12, seed=9)
    inp = with_initial_state(policy, inp)
    assert set(inp.state) == {"acc"}
    state = step(policy, inp, None).state  # the base's accumulation runs under the meta score
    assert state["acc"].sum() > 0
    snap = EvictionConfig.from_spec("fastcaote+snapkv", budget=64, window=16).build_policy()
    assert snap.one_shot and snap.query_window == 16 and snap.protected_count(64) == 16
    assert not snap.is_attention_mass
