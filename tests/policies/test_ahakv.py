"""AhaKV (spec ahakv.md): SG-softmax gain, value prior, recent window, decode accumulation, options."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.ahakv import AhaKV, sg_gain, value_prior
from vllm_evict.policies.base import Phase

from .helpers import one_row, step, with_budget


# The reading the formula tests below are written for: the gain on the raw q.k, F not pooled (the
# options' other values are tested against their own formulas).
RAW = {"gain": "raw", "pooling": "none"}


def gain_of(length: int, budget: int) -> float:
    return float(sg_gain(torch.tensor([length]), torch.tensor([budget]))[0])


def prior(vnorm: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """``value_prior`` of one request's vnorm / positions [H, n] (no padding): [H, n]."""
    valid = torch.ones(1, 1, vnorm.shape[-1], dtype=torch.bool)
    return value_prior(vnorm.unsqueeze(0), positions.unsqueeze(0), valid, kernel)[0]


def build(h_kv=2, group=3, n=60, d=8, w=8, seed=0, phase=Phase.PROMPT_END, positions=None, shuffle=False):
    """Inputs of one layer as a 1-row batch; ``positions`` [n] (ascending logical positions) default to 0..n-1.

    ``shuffle`` permutes every head's slots differently, as compaction may leave them.
    """
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(n) if positions is None else torch.as_tensor(positions)
    pos = pos.expand(h_kv, n).clone()
    keys = torch.randn(h_kv, n, d, generator=g) * 1.5
    values = torch.randn(h_kv, n, d, generator=g) * (0.2 + torch.rand(h_kv, n, 1, generator=g))
    if shuffle:
        for h in range(h_kv):
            perm = torch.randperm(n, generator=g)
            pos[h] = pos[h][perm]
    queries = torch.randn(h_kv * group, w, d, generator=g) * 1.5
    last = int(pos.max())
    qpos = torch.arange(last - w + 1, last + 1)
    return one_row(keys, values, pos, queries, qpos, d ** -0.5, seq_len=last + 1,
                   num_new=n if phase is not Phase.DECODE else 1, phase=phase)


def with_init_state(policy, inp):
    computed = policy.init_state(inp.keys[0], inp.values[0], None)
    assert set(computed) == {"vnorm"}  # the score starts at 0 (the engine writes the zeros)
    return inp.with_state({"vnorm": computed["vnorm"].unsqueeze(0), "score": inp.zeros()})


# ---- naive reference, written straight from the spec's formulas ----------------------------------
def naive_sg_rows(inp, rows, eta):
    """sum over the given query rows and the group's heads of softmax(eta * s * q.k) over visible keys
    (row 0 of the batch): [H_kv, n]."""
    keys, positions, queries, qpos = inp.keys[0], inp.positions[0], inp.queries[0], inp.query_positions[0]
    h_kv, n, _ = keys.shape
    group = queries.shape[0] // h_kv
    eta = float(eta)
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_kv):
        k = keys[h].double()
        for gq in range(h * group, (h + 1) * group):
            for r in rows:
                q = queries[gq, r].double()
                visible = [j for j in range(n) if int(positions[h, j]) <= int(qpos[r])]
                z = torch.tensor([eta * inp.scale * float(q @ k[j]) for j in visible], dtype=torch.float64)
                p = torch.softmax(z, dim=0)
                for j, pj in zip(visible, p):
                    out[h, j] += pj
    return out


def naive_value_prior(inp, kernel):
    values, positions = inp.values[0], inp.positions[0]
    h_kv, n, _ = values.shape
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_kv):
        nu = (values[h].double() ** 2).sum(-1)
        order = sorted(range(n), key=lambda j: int(positions[h, j]))
        for t, j in enumerate(order):
            lo, hi = max(0, t - kernel // 2), min(n, t + kernel // 2 + 1)
            out[h, j] = sum(nu[order[u]] for u in range(lo, hi)) / (hi - lo)  # only existing tokens
        out[h] /= out[h].max()
    return out


def naive_fhat(inp, budget, recent=32, kernel=5):
    eta = math.sqrt(2 * max(math.log(int(inp.seq_len[0]) / budget), 0.0))
    w = inp.queries.shape[2]
    rows = range(max(0, w - recent), w)
    return naive_value_prior(inp, kernel) * naive_sg_rows(inp, rows, eta)


def top_set(score, protected, budget):
    """Indices kept by 'protected + top score' for one head."""
    rest = budget - int(protected.sum())
    cand = [j for j in range(score.shape[0]) if not protected[j]]
    cand.sort(key=lambda j: (-float(score[j]), j))
    return sorted([j for j in range(score.shape[0]) if protected[j]] + cand[:rest])


# ---- the gain ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,budget,expected", [
    (4000, 720, 1.85), (8000, 1000, 2.04), (32000, 1000, 2.63),  # spec §3.3 examples
    (1000, 200, 1.79), (1000, 40, 2.54), (1000, 600, 1.01),  # ratio budgets beta = 0.2, 0.04, 0.6
])
def test_gain_matches_spec_examples(length, budget, expected):
    # fp32 per row (it multiplies fp32 logits), computed in float64
    assert gain_of(length, budget) == pytest.approx(math.sqrt(2 * math.log(length / budget)), rel=1e-7)
    assert gain_of(length, budget) == pytest.approx(expected, abs=0.006)


@pytest.mark.parametrize("length,budget", [(720, 720), (500, 720), (1, 2), (0, 5), (5, 0)])
def test_gain_is_zero_when_row_not_longer_than_budget(length, budget):
    assert gain_of(length, budget) == 0.0


def test_gain_per_row():
    lengths, budgets = torch.tensor([4000, 8000, 500, 32000]), torch.tensor([720, 1000, 720, 1000])
    expected = [math.sqrt(2 * max(math.log(i / k), 0.0)) for i, k in zip(lengths.tolist(), budgets.tolist())]
    got = sg_gain(lengths, budgets)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert got.tolist() == pytest.approx(expected, rel=1e-7)


def test_gain_uses_logical_length_and_given_budget():
    inp = build(n=40, positions=list(range(0, 4000, 100)), w=4)  # an evicted cache: seq_len 3901
    pol = AhaKV(recent=4, **RAW)
    assert inp.seq_len.tolist() == [3901]
    assert float(pol.logit_gain(with_budget(inp, 720))[0]) == pytest.approx(math.sqrt(2 * math.log(3901 / 720)))
    # without a budget: the physical size stands in for it
    assert float(pol.logit_gain(inp)[0]) == pytest.approx(math.sqrt(2 * math.log(3901 / 40)))


def test_gain_readings():
    """What the paper's lambda = sqrt(2 ln(i/k) / d) multiplies: the raw q.k (default; eta = lambda sqrt(d) on
    the scaled logits), the already-scaled logits (Algorithm 1 literally: eta = lambda), or nothing."""
    inp = with_budget(build(n=40, positions=list(range(0, 4000, 100)), w=4, d=16), 720)
    eta = math.sqrt(2 * math.log(3901 / 720))
    assert float(AhaKV(recent=4, **RAW).logit_gain(inp)[0]) == pytest.approx(eta)
    assert float(AhaKV(recent=4, gain="scaled").logit_gain(inp)[0]) == pytest.approx(eta / 4.0)  # sqrt(d) = 4
    assert AhaKV(recent=4, gain="none").logit_gain(inp) is None
    # The reading changes the score: a plain softmax is flatter than the sharpened one here (eta > 1).
    sharp, plain = AhaKV(recent=4, **RAW).window_score(inp), AhaKV(recent=4, gain="none").window_score(inp)
    assert float(sharp.max()) > float(plain.max())
    torch.testing.assert_close(sharp.sum(-1), plain.sum(-1))  # both sum 4 rows x G heads of mass 1


# ---- prefill scoring -------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 3, 7])
def test_refined_score_equals_naive_formula(group):
    inp = build(h_kv=2, group=group, n=48, d=8, w=10, seed=group, shuffle=True,
                positions=list(range(0, 480, 10))[:-6] + list(range(474, 480)))  # sparse history + dense tail
    pol = AhaKV(recent=6, value_kernel=5, **RAW)
    inp = with_init_state(pol, inp)
    budget = 20
    expected = naive_fhat(inp, budget, recent=6, kernel=5)
    got = pol.refined_score(with_budget(inp, budget))[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)
    # the gain really is in there: the plain softmax (gain 1) gives other scores
    plain = naive_value_prior(inp, 5) * naive_sg_rows(inp, range(4, 10), 1.0)
    assert not torch.allclose(got.double(), plain, rtol=1e-3, atol=1e-4)


def naive_avg_pool(score, positions, kernel):
    """SnapKV's pooling of [H, n] scores along each head's logical order: zero padding, divided by the
    full kernel."""
    out = torch.zeros_like(score, dtype=torch.float64)
    for h in range(score.shape[0]):
        order = sorted(range(score.shape[1]), key=lambda j: int(positions[h, j]))
        for t, j in enumerate(order):
            lo, hi = max(0, t - kernel // 2), min(len(order), t + kernel // 2 + 1)
            out[h, j] = sum(float(score[h, order[u]]) for u in range(lo, hi)) / kernel
    return out


@pytest.mark.parametrize("prior_option,pooling", [("none", "none"), ("value", "avg"), ("none", "avg")])
def test_prior_and_pooling_options_follow_the_formula(prior_option, pooling):
    """prior "none": F_hat = F (the 'w/o VPE' ablation); pooling "avg": F smoothed as SnapKV smooths its
    window mass (the window's columns zeroed, kernel 7, zero padding) before the prior."""
    inp = build(h_kv=2, group=2, n=40, d=8, w=8, seed=5, shuffle=True)
    pol = AhaKV(recent=6, value_kernel=5, prior=prior_option, pooling=pooling, kernel=7, gain="raw")
    inp = with_init_state(pol, inp)
    budget = 12
    eta = math.sqrt(2 * max(math.log(int(inp.seq_len[0]) / budget), 0.0))
    expected = naive_sg_rows(inp, range(2, 8), eta)
    if pooling == "avg":  # the recent window's own columns are zeroed first, as SnapKV does
        recent = inp.positions[0] > int(inp.positions[0].max()) - 6
        expected = naive_avg_pool(expected.masked_fill(recent, 0.0), inp.positions[0], 7)
    if prior_option == "value":
        expected = naive_value_prior(inp, 5) * expected
    got = pol.refined_score(with_budget(inp, budget))[0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)
    default = AhaKV(recent=6, value_kernel=5, **RAW).refined_score(with_budget(inp, budget))[0]
    assert not torch.allclose(got, default, rtol=1e-3, atol=1e-5)  # each option changes the score


def test_value_prior_pools_in_position_order_without_padding():
    vnorm = torch.tensor([[4.0, 1.0, 0.0, 2.0, 8.0]])
    positions = torch.tensor([[3, 0, 4, 1, 2]])  # logical order of nu: 1, 2, 8, 4, 0
    got = prior(vnorm, positions, 3)
    # pooled in logical order (count_include_pad=False): [1.5, 11/3, 14/3, 4, 2] -> / (14/3)
    pooled = {0: 1.5, 1: 11 / 3, 2: 14 / 3, 3: 4.0, 4: 2.0}
    expected = torch.tensor([[pooled[int(p)] / (14 / 3) for p in positions[0]]])
    torch.testing.assert_close(got, expected)
    assert float(got.max()) == 1.0


def test_value_prior_of_all_zero_values_is_zero():
    assert torch.equal(prior(torch.zeros(1, 6), torch.arange(6).view(1, 6), 5), torch.zeros(1, 6))


def test_value_prior_ignores_padding():
    """Padding slots (in any logical position) neither enter a real slot's pool nor the per-head max."""
    vnorm = torch.tensor([[4.0, 1.0, 0.0, 2.0, 8.0]])
    positions = torch.tensor([[3, 0, 4, 1, 2]])
    alone = prior(vnorm, positions, 3)
    padded_v = torch.cat([vnorm, torch.tensor([[1e6, 1e6]])], dim=1).unsqueeze(0)
    padded_p = torch.cat([positions, torch.tensor([[1, 9]])], dim=1).unsqueeze(0)
    valid = torch.tensor([[[True] * 5 + [False] * 2]])
    got = value_prior(padded_v, padded_p, valid, 3)[0]
    torch.testing.assert_close(got[:, :5], alone)
    assert (got[:, 5:] == 0).all()


@pytest.mark.parametrize("group", [1, 3, 7])
def test_prompt_end_eviction_keeps_recent_plus_top_fhat_and_seeds_score(group):
    inp = build(h_kv=2, group=group, n=64, w=8, seed=10 + group, shuffle=True)
    pol = AhaKV(recent=8, **RAW)
    inp = with_init_state(pol, inp)
    budget = 24
    res = step(pol, inp, budget)
    fhat = naive_fhat(inp, budget, recent=8)
    torch.testing.assert_close(res.state["score"][0].double(), fhat, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(res.state["vnorm"], inp.state["vnorm"])
    assert res.keep.shape == (1, 2, budget)
    for h in range(2):
        recent = inp.positions[0, h] >= inp.seq_len[0] - 8
        assert res.keep[0, h].tolist() == top_set(fhat[h], recent, budget)


def test_recent_window_kept_even_when_its_values_are_zero():
    inp = build(h_kv=1, group=2, n=50, w=6, seed=3)
    inp.values[0, :, -10:] = 0.0  # window tokens (and neighbours) get value prior 0
    pol = AhaKV(recent=6, **RAW)
    inp = with_init_state(pol, inp)
    res = step(pol, inp, 12)
    assert set(range(44, 50)) <= set(res.keep[0, 0].tolist())
    assert torch.all(res.state["score"][0, 0, -6:] == 0)


def test_sinks_option_protects_first_tokens():
    inp = build(h_kv=2, group=1, n=50, w=4, seed=4)
    inp.values[0, :, :3] = 0.0
    pol = AhaKV(recent=4, sinks=3, **RAW)
    res = step(pol, with_init_state(pol, inp), 10)
    for h in range(2):
        assert {0, 1, 2} <= set(res.keep[0, h].tolist())
    res0 = step(AhaKV(recent=4, **RAW), with_init_state(pol, inp), 10)
    assert not {0, 1}.issubset(set(res0.keep[0, 0].tolist()))  # value prior 0 and far from the window


def test_longer_context_gives_sharper_scores():
    """Same keys and queries; a longer logical length raises the gain, concentrating F on fewer tokens."""
    pol = AhaKV(recent=8, **RAW)
    n, budget = 80, 60

    def fmass(stride):
        pos = [j * stride for j in range(n - 8)]
        pos += list(range(pos[-1] + 1, pos[-1] + 9))
        inp = with_budget(build(h_kv=2, group=3, n=n, w=8, seed=5, positions=pos), budget)
        f = pol.window_score(inp)[0, :, : n - 8]
        return f / f.sum(-1, keepdim=True), float(pol.logit_gain(inp)[0])

    short, g_short = fmass(1)  # seq_len 80: gain sqrt(2 ln(80/60)) ~ 0.76
    long, g_long = fmass(100)  # seq_len ~7.1k: gain ~ 3.1
    assert g_long > g_short > 0
    entropy = lambda p: -(p * p.clamp_min(1e-30).log()).sum(-1)
    assert torch.all(entropy(long) < entropy(short) - 0.3)
    assert torch.all(long.max(-1).values > short.max(-1).values)


def test_prefill_chunk_without_eviction_leaves_state_alone():
    inp = build(n=30, w=8, phase=Phase.PREFILL)
    pol = AhaKV(recent=8, **RAW)
    state = {"vnorm": torch.rand(1, 2, 30), "score": torch.rand(1, 2, 30)}
    res = step(pol, inp.with_state(state), None)
    assert res.keep is None
    assert torch.equal(res.state["score"], state["score"]) and torch.equal(res.state["vnorm"], state["vnorm"])


def test_prefill_eviction_seeds_score_with_fhat():
    inp = build(h_kv=2, group=3, n=70, w=8, seed=6, phase=Phase.PREFILL)
    pol = AhaKV(recent=8, **RAW)
    inp = with_init_state(pol, inp)
    res = step(pol, inp, 30)
    torch.testing.assert_close(res.state["score"][0].double(), naive_fhat(inp, 30, recent=8), rtol=1e-4, atol=1e-6)
    assert res.keep.shape == (1, 2, 30)


def test_prompt_end_without_eviction_still_seeds_score():
    # prompt of 40 tokens under a larger budget: no eviction (budget None); i <= k, so gain 0 (uniform rows)
    inp = build(h_kv=2, group=3, n=40, w=8, seed=7)
    pol = AhaKV(recent=8, **RAW)
    inp = with_init_state(pol, inp)
    res = step(pol, inp, None)
    assert res.keep is None
    expected = naive_value_prior(inp, 5) * naive_sg_rows(inp, range(8), 0.0)
    torch.testing.assert_close(res.state["score"][0].double(), expected, rtol=1e-5, atol=1e-7)
    assert float(res.state["score"].min()) > 0


# ---- decode ----------------------------------------------------------------------------------------
def decode_inputs(group=3, n=30, w=8, seed=8, shuffle=True):
    """A decode step: candidates = evicted history + this step's token (the last slot)."""
    pos = list(range(0, 3 * (n - 1), 3)) + [3 * (n - 1)]
    inp = build(h_kv=2, group=group, n=n, w=w, seed=seed, phase=Phase.DECODE, positions=pos)
    if shuffle:  # old slots in any order, the new token stays last
        g = torch.Generator().manual_seed(seed)
        for h in range(2):
            perm = torch.cat([torch.randperm(n - 1, generator=g), torch.tensor([n - 1])])
            inp.positions[0, h] = inp.positions[0, h][perm]
    pol = AhaKV(recent=4, **RAW)
    old = {"vnorm": torch.rand(2, n - 1) + 0.1, "score": torch.rand(2, n - 1) * 3}
    new = pol.init_state(inp.keys[0, :, -1:], inp.values[0, :, -1:], None)
    new["score"] = torch.zeros(2, 1)  # a new token's score starts at 0
    state = {k: torch.cat([old[k], new[k]], dim=1).unsqueeze(0) for k in old}
    return pol, inp.with_state(state)


@pytest.mark.parametrize("group", [1, 3, 7])
def test_decode_adds_sg_row_of_this_query_and_new_token_starts_at_zero(group):
    pol, inp = decode_inputs(group=group)
    assert float(inp.state["score"][0, :, -1].abs().max()) == 0.0  # new tokens start at 0
    budget = 20
    res = step(pol, inp, None)  # no eviction: k falls back to the physical size
    w = inp.queries.shape[2]
    seq_len, n = int(inp.seq_len[0]), int(inp.lengths[0])
    row = naive_sg_rows(inp, [w - 1], gain_of(seq_len, n))
    old = inp.state["score"][0].double()
    torch.testing.assert_close(res.state["score"][0].double(), old + row, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res.state["score"][0, :, -1].double(), row[:, -1], rtol=1e-5, atol=1e-7)
    assert torch.equal(res.state["vnorm"], inp.state["vnorm"])  # no value prior in decode
    # with the budget known (an evicting step) the gain uses it
    res_b = step(pol, inp, budget)
    row_b = naive_sg_rows(inp, [w - 1], gain_of(seq_len, budget))
    torch.testing.assert_close(res_b.state["score"][0].double(), old + row_b, rtol=1e-5, atol=1e-6)


def test_decode_sums_row_mass_per_group():
    pol, inp = decode_inputs(group=7)
    inc = step(pol, inp, None).state["score"] - inp.state["score"]
    torch.testing.assert_close(inc.sum(-1), torch.full((1, 2), 7.0))  # one softmax row per query head


def test_decode_eviction_keeps_recent_plus_top_score():
    pol, inp = decode_inputs(group=3, n=30)
    budget = 12
    res = step(pol, inp, budget)
    for h in range(2):
        recent = inp.positions[0, h] > inp.positions[0, h].max() - 4
        assert res.keep[0, h].tolist() == top_set(res.state["score"][0, h], recent, budget)


def test_decode_over_several_steps_accumulates():
    pol, inp = decode_inputs(group=1, n=20, shuffle=False)
    total = inp.state["score"][0].clone()
    state = inp.state
    for t in range(3):
        step_inp = inp.with_state(state)
        res = step(pol, step_inp, None)
        total = total + naive_sg_rows(step_inp, [inp.queries.shape[2] - 1], pol.logit_gain(step_inp)[0]).float()
        state = res.state
    torch.testing.assert_close(state["score"][0], total, rtol=1e-5, atol=1e-5)


# ---- attention mass and the engine-facing contract ------------------------------------------------
def test_attention_mass_is_fhat_in_prompt_and_score_in_decode():
    inp = build(h_kv=2, group=3, n=50, w=8, seed=9)
    pol = AhaKV(recent=8, **RAW)
    inp = with_init_state(pol, inp)
    mass = pol.attention_mass(inp)
    assert torch.isfinite(mass).all() and (mass >= 0).all()
    torch.testing.assert_close(mass, pol.refined_score(inp))
    pol_d, inp_d = decode_inputs()
    torch.testing.assert_close(pol_d.attention_mass(inp_d), inp_d.state["score"])
    scores = pol.scores(inp)[0]
    assert torch.isinf(scores[:, -8:]).all() and torch.isfinite(scores[:, :-8]).all()


def test_class_contract():
    pol = EvictionConfig.from_spec("ahakv", 100, recent=16).build_policy()
    assert isinstance(pol, AhaKV)
    assert pol.query_window == 16 and pol.one_shot and pol.is_attention_mass and pol.needs_every_step
    assert pol.state_names == ("vnorm", "score", "wmass") and pol.computed_state == ("vnorm",)
    assert pol.window_at_prompt_end and not pol.window_in_decode
    assert pol.protected_count(100) == 16
    assert EvictionConfig.from_spec("ahakv", 100).schedule == "oneshot"
    v = torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])
    st = pol.init_state(torch.zeros(1, 2, 2), v, None)
    assert st["vnorm"].tolist() == [[25.0, 1.0]] and set(st) == {"vnorm"}  # the score starts at 0


@pytest.mark.parametrize("options,match", [
    ({"recent": 0}, r"recent must be an integer in \[1, 2147483647\]"),
    ({"recent": -3}, r"recent must be an integer in \[1, 2147483647\]"),
    ({"recent": 2.5}, r"recent must be an integer in \[1, 2147483647\]"),
    ({"value_kernel": 4}, r"value_kernel must be an odd integer in \[1, 31\]"),
    ({"value_kernel": 0}, r"value_kernel must be an odd integer in \[1, 31\]"),
    ({"sinks": -1}, r"sinks must be an integer in \[0, 2147483647\]"),
    ({"recent": 60, "sinks": 40}, r"budget 100 must be larger than the 100 tokens ahakv always keeps"),
    ({"window": 8}, r"unknown option 'window' for ahakv"),
    ({"gain": "linear"}, r"gain must be one of raw, scaled, none; got 'linear'"),
    ({"prior": "key"}, r"prior must be one of value, none; got 'key'"),
    ({"pooling": "max"}, r"pooling must be one of none, avg; got 'max'"),
    ({"kernel": 6}, r"kernel must be an odd integer in \[1, 31\]"),
])
def test_invalid_options(options, match):
    with pytest.raises(ValueError, match=match):
        EvictionConfig.from_spec("ahakv", 100, **options)
