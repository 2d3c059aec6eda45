"""CriticalKV: projected-value L1 norms and the two-stage selection."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_evict import dense
from vllm_evict.config import EvictionConfig
from vllm_evict.dense import protect, value_norms
from vllm_evict.policies.base import EvictionInputs, Policy
from vllm_evict.policies.criticalkv import CriticalKV, two_stage_keep

from .helpers import make_inputs, naive_rows_of, step, with_budget, with_initial_state


def keep_one(s1, nu, protected, budget, alpha, epsilon):
    """``two_stage_keep`` of one request (s1, nu, protected [H, n]; no padding): kept slots [H, budget]."""
    valid = torch.ones(1, 1, s1.shape[-1], dtype=torch.bool)
    keep = two_stage_keep(s1.unsqueeze(0), nu.unsqueeze(0), protected.unsqueeze(0), valid, torch.tensor([budget]),
                          budget, alpha, epsilon)
    return keep[0]


def nu_by_loop(values: torch.Tensor, o_proj: torch.Tensor) -> torch.Tensor:
    """Per query head h: ||v_j @ o_proj[:, h*d:(h+1)*d].T||_1, then the mean over each KV head's group."""
    h_kv, m, d = values.shape
    h_q = o_proj.shape[1] // d
    group = h_q // h_kv
    out = torch.zeros(h_kv, m, dtype=torch.float64)
    for h in range(h_q):
        w_h = o_proj[:, h * d:(h + 1) * d].double()  # [hidden, d]
        for j in range(m):
            out[h // group, j] += (w_h @ values[h // group, j].double()).abs().sum() / group
    return out


class FixedMass(Policy):
    """Test base for one request: a given mass and protection [H, n], a mass summing ``rows`` query rows,
    and its own state 'acc'."""

    name = "fixedmass"
    is_attention_mass = True
    state_names = ("acc",)

    def __init__(self, mass: torch.Tensor, protected: torch.Tensor, rows: int = 1) -> None:
        super().__init__()
        self._mass, self._protected, self._rows = mass.unsqueeze(0), protected.unsqueeze(0), rows

    @property
    def query_window(self) -> int:
        return self._rows

    def attention_mass(self, inp: EvictionInputs) -> torch.Tensor:
        return self._mass

    def mass_rows(self, inp: EvictionInputs) -> torch.Tensor:
        return torch.full((inp.num_rows,), self._rows)

    def protected_mask(self, inp: EvictionInputs) -> torch.Tensor:
        return self._protected

    def scores(self, inp: EvictionInputs) -> torch.Tensor:
        return protect(self._mass, self._protected)


@pytest.mark.parametrize("h_kv,group,hidden", [(2, 2, 24), (1, 4, 10), (3, 1, 7)])
def test_nu_matches_an_explicit_per_head_loop(h_kv, group, hidden):
    gen = torch.Generator().manual_seed(h_kv * 10 + group)
    d, m = 8, 13
    values = torch.randn(h_kv, m, d, generator=gen)
    o_proj = torch.randn(hidden, h_kv * group * d, generator=gen)
    nu = value_norms(values, o_proj)
    assert nu.shape == (h_kv, m) and nu.dtype == torch.float32
    torch.testing.assert_close(nu.double(), nu_by_loop(values, o_proj), rtol=1e-5, atol=1e-5)


def test_nu_in_token_blocks_equals_all_at_once(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 50, 4, generator=gen)
    o_proj = torch.randn(16, 2 * 2 * 4, generator=gen).to(torch.bfloat16)
    whole = value_norms(values, o_proj)
    monkeypatch.setattr(dense, "_VALUE_NORM_BLOCK", 3 * 4 * 16)  # 3 tokens per block, a ragged last one
    torch.testing.assert_close(value_norms(values, o_proj), whole)
    torch.testing.assert_close(whole.double(), nu_by_loop(values, o_proj.float()), rtol=1e-5, atol=1e-5)


def test_init_state_merges_base_state_and_nu():
    inp = make_inputs(h_kv=2, group=2, n=20, d=8, w=4, seed=1)
    policy = EvictionConfig.from_spec("criticalkv+h2o", budget=10).build_policy()
    assert policy.state_names == ("acc", "nu") and policy.needs_o_proj and policy.needs_every_step
    assert policy.computed_state == ("nu",)  # acc starts at 0 (the engine writes the zeros)
    computed = policy.init_state(inp.keys[0], inp.values[0], inp.o_proj)
    assert set(computed) == {"nu"}
    torch.testing.assert_close(computed["nu"].double(), nu_by_loop(inp.values[0], inp.o_proj), rtol=1e-5, atol=1e-5)
    state = with_initial_state(policy, inp).state
    assert set(state) == {"acc", "nu"} and torch.equal(state["acc"], torch.zeros(1, 2, 20))
    # The base's per-step update keeps nu (H2O rebuilds its state dict).
    new_state = step(policy, inp.with_state(state), None).state
    assert torch.equal(new_state["nu"], state["nu"]) and new_state["acc"].sum() > 0


def test_missing_o_proj_or_nu_is_a_clear_error():
    inp = make_inputs(h_kv=1, group=2, n=10, d=4, w=2)
    policy = EvictionConfig.from_spec("criticalkv+snapkv", budget=6, window=2).build_policy()
    with pytest.raises(ValueError, match="output projection weight"):
        policy.init_state(inp.keys[0], inp.values[0], None)
    with pytest.raises(ValueError, match="state 'nu'"):
        policy.select(with_budget(inp, 6))
    with pytest.raises(ValueError, match=r"o_proj must be \[hidden, H_q\*4\] with H_q a multiple of 1 KV heads, "
                                         r"got shape \(8, 9\)"):
        value_norms(inp.values[0], torch.zeros(8, 9))
    with pytest.raises(ValueError, match=r"o_proj must be \[hidden, H_q\*4\] with H_q a multiple of 2 KV heads"):
        value_norms(torch.zeros(2, 3, 4), torch.zeros(8, 12))  # 3 query heads for 2 KV heads


# Hand-made example: 10 tokens, the last two protected; token 6 has little attention but a huge nu.
S1 = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.05, 0.04, 0.03, 0.02, 0.5, 0.5]])
NU = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0, 1.0, 1.0, 1.0]])
PROT = torch.tensor([[False] * 8 + [True] * 2])


def test_two_stage_split_on_a_hand_made_example():
    # b = 6, alpha = 0.5: b1 = 3 of which 2 protected -> S1 = {0}; k2 = 3 by (s1 + eps) * nu -> {6, 1, 2}.
    keep = keep_one(S1, NU, PROT, budget=6, alpha=0.5, epsilon=1e-4)
    assert keep.tolist() == [[0, 1, 2, 6, 8, 9]]
    # Attention alone (alpha = 1) would keep token 3 rather than the low-attention token 6.
    assert keep_one(S1, NU, PROT, budget=6, alpha=1.0, epsilon=1e-4).tolist() == [[0, 1, 2, 3, 8, 9]]
    # b1 = floor(0.5 * 9) = 4 -> S1 = {0, 1}; k2 = 5 -> {6, 2, 3, 4, 5}
    assert keep_one(S1, NU, PROT, budget=9, alpha=0.5, epsilon=1e-4).tolist() == [[0, 1, 2, 3, 4, 5, 6, 8, 9]]
    # b1 = floor(0.34 * 7) = 2 <= protected: no stage 1, k2 = 7 - 2 = 5 -> {6, 0, 1, 2, 3}
    assert keep_one(S1, NU, PROT, budget=7, alpha=0.34, epsilon=1e-4).tolist() == [[0, 1, 2, 3, 6, 8, 9]]


def test_stage_one_protects_high_attention_from_stage_two():
    # b = 4, alpha = 0.5, nothing protected: stage 1 takes token 0 (top attention) and 1; stage 2 ranks by
    # nu, under which token 0 would lose, yet it is kept.
    s1 = torch.tensor([[0.6, 0.2, 0.1, 0.05, 0.05]])
    nu = torch.tensor([[0.01, 1.0, 10.0, 10.0, 9.0]])
    none = torch.zeros(1, 5, dtype=torch.bool)
    assert keep_one(s1, nu, none, budget=4, alpha=0.5, epsilon=0.0).tolist() == [[0, 1, 2, 3]]
    assert keep_one(s1, nu, none, budget=3, alpha=0.5, epsilon=0.0).tolist() == [[0, 2, 3]]
    # epsilon lifts zero-attention tokens with a large nu into stage 2.
    s1 = torch.tensor([[0.5, 0.1, 0.0, 0.0]])
    nu = torch.tensor([[1.0, 1.0, 1e6, 1.0]])
    assert keep_one(s1, nu, torch.zeros(1, 4, dtype=torch.bool), 2, 0.5, 1e-4).tolist() == [[0, 2]]
    assert keep_one(s1, nu, torch.zeros(1, 4, dtype=torch.bool), 2, 0.5, 0.0).tolist() == [[0, 1]]


def test_policy_select_uses_mass_over_rows_and_state_nu():
    # The same example through the policy: a base summing 4 window rows gives mass 4 * s1.
    inp = make_inputs(h_kv=1, group=1, n=10, d=4, w=4)
    policy = CriticalKV(FixedMass(S1 * 4, PROT, rows=4))
    policy.check_options()
    inp = inp.with_state({"acc": torch.zeros(1, 1, 10), "nu": NU.unsqueeze(0)})
    torch.testing.assert_close(policy.stage1_scores(inp), S1.unsqueeze(0))
    assert step(policy, inp, 6).keep.tolist() == [[[0, 1, 2, 6, 8, 9]]]
    s = policy.scores(inp)[0]
    assert torch.isinf(s[0, 8:]).all()
    torch.testing.assert_close(s[0, :8], ((S1 + 1e-4) * NU)[0, :8])


def test_snapkv_mass_is_normalised_by_window_rows():
    inp = make_inputs(h_kv=2, group=2, n=48, d=8, w=8, seed=3)
    policy = EvictionConfig.from_spec("criticalkv+snapkv", budget=20, window=8).build_policy()
    inp = with_initial_state(policy, inp)
    torch.testing.assert_close(policy.stage1_scores(inp), policy.base.ranking_mass(inp) / 8)
    h2o = EvictionConfig.from_spec("criticalkv+h2o", budget=20).build_policy()
    acc = torch.rand(1, 2, 48)
    torch.testing.assert_close(h2o.stage1_scores(inp.with_state({"acc": acc})), acc / 48)  # seq_len rows
    tova = EvictionConfig.from_spec("criticalkv+tova", budget=20).build_policy()
    torch.testing.assert_close(tova.stage1_scores(inp), tova.base.ranking_mass(inp))  # one row


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_stage_one_drops_the_window_columns_before_pooling(pooling):
    """Spec §2.5 steps 3-5: mean over the window rows of each query head, the window's own columns dropped,
    pooled (kernel 7, zero padding at the cut), then the group mean, written out in float64."""
    h_kv, group, n, w = 2, 3, 40, 8
    inp = make_inputs(h_kv=h_kv, group=group, n=n, d=8, w=w, seed=12)
    policy = EvictionConfig.from_spec("criticalkv+snapkv", budget=24, window=w, pooling=pooling).build_policy()
    inp = with_initial_state(policy, inp)
    rows = naive_rows_of(inp)
    prefix = rows[:, :, :n - w].mean(dim=1)  # [H_q, n - w]
    pool = torch.nn.functional.avg_pool1d if pooling == "avg" else torch.nn.functional.max_pool1d
    pooled = pool(prefix.unsqueeze(1), 7, stride=1, padding=3).squeeze(1)
    expected = pooled.view(h_kv, group, n - w).mean(dim=1)
    got = policy.stage1_scores(inp)[0]
    torch.testing.assert_close(got[:, :n - w].double(), expected, rtol=1e-5, atol=1e-7)
    if pooling == "avg":
        # CAOTE's mass is pooled over the whole axis: it differs exactly on the 3 tokens before the window,
        # which pick up the window's attention to itself there, and agrees on every earlier token.
        whole = policy.base.attention_mass(inp)[0] / w
        torch.testing.assert_close(got[:, :n - w - 3], whole[:, :n - w - 3])
        assert bool((whole[:, n - w - 3:n - w] > got[:, n - w - 3:n - w]).all())


@pytest.mark.parametrize("seed", range(6))
def test_keeps_exactly_budget_protected_and_top_stage_one(seed):
    gen = torch.Generator().manual_seed(seed)
    h, n = 4, 60
    s1 = torch.rand(h, n, generator=gen)
    nu = torch.rand(h, n, generator=gen) * 10
    protected = torch.rand(h, n, generator=gen) < 0.1
    protected[:, -3:] = True  # at least 3, and a different count per head
    budget = int(torch.randint(12, 40, (1,), generator=gen))
    alpha = float(torch.rand(1, generator=gen)) * 0.9 + 0.1
    keep = keep_one(s1, nu, protected, budget, alpha, 1e-4)
    assert keep.shape == (h, budget)
    b1 = math.floor(alpha * budget)
    for i in range(h):
        kept = keep[i].tolist()
        assert kept == sorted(set(kept))
        assert set(protected[i].nonzero().flatten().tolist()) <= set(kept)
        free = (~protected[i]).nonzero().flatten()
        k1 = max(0, b1 - int(protected[i].sum()))
        top1 = free[torch.topk(s1[i, free], k1).indices].tolist() if k1 else []
        assert set(top1) <= set(kept)
        rest = [j for j in free.tolist() if j not in top1]
        k2 = budget - max(b1, int(protected[i].sum()))
        s2 = (s1[i] + 1e-4) * nu[i]
        top2 = sorted(rest, key=lambda j: -float(s2[j]))[:k2]
        assert sorted(set(top1) | set(top2) | set(protected[i].nonzero().flatten().tolist())) == kept


def test_end_to_end_with_snapkv_keeps_window_and_budget():
    inp = make_inputs(h_kv=2, group=2, n=64, d=8, w=8, seed=5)
    policy = EvictionConfig.from_spec("criticalkv+snapkv", budget=24, window=8, pooling="max").build_policy()
    assert policy.base.pooling == "max"
    result = step(policy, with_initial_state(policy, inp), 24)
    assert result.keep.shape == (1, 2, 24)
    for h in range(2):
        assert set(range(56, 64)) <= set(result.keep[0, h].tolist())
    assert set(result.state) == {"nu"}


@pytest.mark.parametrize("options,message", [
    ({"alpha": 0.0}, r"alpha must be a number in \(0, 1\], got 0.0"),
    ({"alpha": 1.5}, r"alpha must be a number in \(0, 1\], got 1.5"),
    ({"alpha": "half"}, "alpha must be a number"),
    ({"epsilon": -1e-3}, r"epsilon must be a number in \[0, 1\], got -0.001"),
])
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig.from_spec("criticalkv+snapkv", budget=64, **options)


def test_nacl_and_ahakv_masses_are_normalised_by_their_own_rows():
    inp = make_inputs(h_kv=2, group=2, n=80, d=8, w=40, seed=6)
    nacl = EvictionConfig.from_spec("criticalkv+nacl", budget=60, proxy=12).build_policy()
    torch.testing.assert_close(nacl.stage1_scores(inp), nacl.base.attention_mass(inp) / 12)
    aha = EvictionConfig.from_spec("criticalkv+ahakv", budget=60, recent=16).build_policy()
    inp = with_initial_state(aha, inp)
    torch.testing.assert_close(aha.stage1_scores(inp), aha.base.attention_mass(inp) / (16 * 2))


@pytest.mark.parametrize("base", ["snapkv", "h2o", "tova", "ahakv", "nacl"])
@pytest.mark.parametrize("meta", ["caote", "fastcaote", "criticalkv"])
def test_every_meta_over_every_mass_base_keeps_budget_and_protection(meta, base):
    inp = make_inputs(h_kv=2, group=2, n=72, d=8, w=32, seed=7)
    options = {"proxy": 8} if base == "nacl" else {}
    policy = EvictionConfig.from_spec(f"{meta}+{base}", budget=40, **options).build_policy()
    inp = with_initial_state(policy, inp)
    result = step(policy, inp, 40)
    assert result.keep.shape == (1, 2, 40)
    protected = policy.protected_mask(with_budget(inp.with_state(result.state), 40))
    for h in range(2):
        kept = result.keep[0, h].tolist()
        assert kept == sorted(set(kept))
        assert set(protected[0, h].nonzero().flatten().tolist()) <= set(kept)
