"""NaCl (spec nacl.md): proxy score, protected tail, budget split, reproducible Gumbel sampling, options."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_evict import dense
from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import Deferred, EvictionInputs, Phase
from vllm_evict.policies.nacl import GUMBEL_STREAM, NaCl, gumbel_noise
from vllm_evict.policies.random_policy import head_draws

from .helpers import one_row, step, with_budget


def build(h_kv=2, group=3, n=120, d=8, w=40, seed=0, phase=Phase.PROMPT_END, positions=None, same_heads=False):
    g = torch.Generator().manual_seed(seed)
    pos = (torch.arange(n) if positions is None else torch.as_tensor(positions)).expand(h_kv, n).clone()
    keys = torch.randn(h_kv, n, d, generator=g) * 1.5
    values = torch.randn(h_kv, n, d, generator=g)
    queries = torch.randn(h_kv * group, w, d, generator=g) * 1.5
    if same_heads:
        keys[:] = keys[0]
        queries = queries[:group].repeat(h_kv, 1, 1)
    last = int(pos.max())
    qpos = torch.arange(last - w + 1, last + 1)
    qpos = torch.where(qpos >= 0, qpos, -1)  # a window longer than the sequence has empty entries
    return one_row(keys, values, pos, queries, qpos, d ** -0.5, seq_len=last + 1,
                   num_new=n if phase is not Phase.DECODE else 1, phase=phase)


def naive_proxy_score(inp, n_p):
    """mean over the group's query heads of sum over the last n_p queries of causal softmax rows (row 0)."""
    keys, positions, queries, qpos = inp.keys[0], inp.positions[0], inp.queries[0], inp.query_positions[0]
    h_kv, n, _ = keys.shape
    group = queries.shape[0] // h_kv
    w = queries.shape[1]
    out = torch.zeros(h_kv, n, dtype=torch.float64)
    for h in range(h_kv):
        for gq in range(h * group, (h + 1) * group):
            for r in range(w - n_p, w):
                vis = [j for j in range(n) if int(positions[h, j]) <= int(qpos[r])]
                z = torch.stack([inp.scale * (queries[gq, r].double() @ keys[h, j].double()) for j in vis])
                for j, p in zip(vis, torch.softmax(z, 0)):
                    out[h, j] += p / group
    return out


class FixedScore(NaCl):
    """NaCl with a prescribed proxy score, to test the selection machinery on its own."""

    fixed: torch.Tensor

    def proxy_score(self, inp, n_proxy):
        return self.fixed.expand(inp.positions.shape).clone()


def fixed(score, **options):
    pol = FixedScore(**options)
    pol.fixed = torch.as_tensor(score, dtype=torch.float32)
    pol.check_options()
    return pol


# ---- proxy score and proxy count -------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 3, 7])
def test_proxy_score_is_group_mean_of_causal_column_sums(group):
    pos = list(range(0, 200, 4)) + list(range(200, 210))  # evicted history + dense tail
    inp = build(h_kv=2, group=group, n=len(pos), w=12, seed=group, positions=pos)
    pol = NaCl(proxy=7)
    got = pol.proxy_score(inp, torch.tensor([7]))
    torch.testing.assert_close(got[0].double(), naive_proxy_score(inp, 7), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(pol.attention_mass(inp), got)
    torch.testing.assert_close(got.sum(-1), torch.full((1, 2), 7.0))  # mean of G rows-of-mass-1, 7 rows
    assert (got >= 0).all() and torch.isfinite(got).all()
    assert pol.mass_rows(inp).tolist() == [7]


@pytest.mark.parametrize("seq_len,budget,expected", [
    (100, 1000, 32),  # the default: the last 32 tokens
    (1000, 1000, 32),  # whatever the prompt's length (the old rule took 10% of it)
    (50_000, 100_000, 32),
    (1000, 60, 28),  # capped at (60 - 4) // 2
    (1000, 9, 2),
])
def test_proxy_count_default(seq_len, budget, expected):
    inp = build(h_kv=1, group=1, n=20, w=NaCl.DEFAULT_PROXY, positions=list(range(seq_len - 20, seq_len)))
    assert NaCl().proxy_count(with_budget(inp, budget)).tolist() == [expected]


def test_proxy_count_bounded_by_available_queries_and_fixed_option():
    inp = with_budget(build(n=100, w=20), 1000)
    assert NaCl().proxy_count(inp).tolist() == [20]
    assert NaCl(proxy=5).proxy_count(inp).tolist() == [5]
    assert NaCl(proxy=500).proxy_count(inp).tolist() == [20]
    assert NaCl(proxy=9).query_window == 9 and NaCl().query_window == NaCl.DEFAULT_PROXY == 32
    # Empty window entries (-1) are not queries.
    inp.query_positions[0, :15] = -1
    assert NaCl().proxy_count(inp).tolist() == [5]
    # Without a budget the cap (B - sinks) // 2 does not apply.
    long = build(h_kv=1, group=1, n=20, w=200, positions=list(range(980, 1000)))
    assert NaCl().proxy_count(with_budget(long, 40)).tolist() == [18]
    assert NaCl().proxy_count(long).tolist() == [32]
    # A request that knows its question's length names it: the proxies are exactly the question.
    assert NaCl(proxy=57).proxy_count(with_budget(long, 1000)).tolist() == [57]


# ---- the split ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.0, 7 / 19, 0.5, 0.7, 1.0])
@pytest.mark.parametrize("budget", [40, 57, 90])
def test_exact_split_counts(ratio, budget):
    inp = build(h_kv=2, group=3, n=150, w=40, seed=1)
    pol = NaCl(proxy=10, sinks=4, random_ratio=ratio)
    inp = with_budget(inp, budget)
    part = pol.partition(inp)
    for a, b in [(part.protected, part.proxy_top), (part.protected, part.random), (part.proxy_top, part.random)]:
        assert not (a & b).any()
    expected_protected = (inp.positions < 4) | (inp.positions >= 140)
    assert torch.equal(part.protected, expected_protected)
    rest = budget - 14
    n_top = math.floor((1 - ratio) * rest + 0.5)
    assert part.proxy_top.sum(-1).tolist() == [[n_top] * 2]
    assert part.random.sum(-1).tolist() == [[rest - n_top] * 2]
    assert (part.protected.sum(-1) + part.proxy_top.sum(-1) + part.random.sum(-1)).tolist() == [[budget] * 2]
    keep = pol.select(inp)
    assert keep.shape == (1, 2, budget)
    for h in range(2):
        assert keep[0, h].tolist() == part.keep_mask[0, h].nonzero().flatten().tolist()


def test_default_split_is_12_to_7():
    pol = NaCl()
    top, rand = pol.split_counts(torch.tensor([19, 190, 0, 1]))
    assert top.tolist() == [12, 120, 0, 1] and rand.tolist() == [7, 70, 0, 0]


@pytest.mark.parametrize("group", [1, 3, 7])
def test_proxy_top_part_is_top_of_score(group):
    inp = build(h_kv=2, group=group, n=130, w=40, seed=2 + group)
    pol = NaCl(proxy=16, sinks=4)
    budget = 60
    part = pol.partition(with_budget(inp, budget))
    score = naive_proxy_score(inp, 16)
    n_top = round((12 / 19) * (budget - 20))
    for h in range(2):
        cand = [j for j in range(130) if not part.protected[0, h, j]]
        cand.sort(key=lambda j: -float(score[h, j]))
        assert set(part.proxy_top[0, h].nonzero().flatten().tolist()) == set(cand[:n_top])


def test_random_ratio_zero_is_deterministic_topk_of_scores():
    inp = with_budget(build(n=100, w=40, seed=4), 30)
    pol = NaCl(proxy=8, random_ratio=0.0)
    keep = pol.select(inp)
    assert torch.equal(keep, pol.select(inp.evolve(seed=torch.tensor([99]))))
    assert torch.equal(keep, dense.topk_keep(pol.scores(inp), inp.valid, inp.budget, inp.budget_max))


def test_budget_cap_keeps_half_of_non_sink_budget_for_selection():
    inp = build(h_kv=1, group=1, n=400, w=200, seed=5)  # rule: max(32, 40) = 40 proxies; cap (50-4)//2 = 23
    pol = NaCl()
    part = pol.partition(with_budget(inp, 50))
    assert int(part.protected.sum()) == 4 + 23
    assert int(part.proxy_top.sum() + part.random.sum()) == 23


def test_decode_phase_eviction():
    pos = list(range(0, 300, 3)) + list(range(300, 310))
    inp = build(h_kv=2, group=3, n=len(pos), w=40, seed=6, phase=Phase.DECODE, positions=pos)
    pol = NaCl(proxy=8)
    res = step(pol, inp, 40)
    assert res.keep.shape == (1, 2, 40)
    for h in range(2):
        kept_pos = set(inp.positions[0, h, res.keep[0, h]].tolist())
        assert set(range(302, 310)) | {0, 3} <= kept_pos  # tail of 8 and the sinks (positions < 4)


# ---- randomness -------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_and_keyed():
    inp = with_budget(build(h_kv=2, group=3, n=200, w=40, seed=7), 60)
    pol = NaCl(proxy=8, random_ratio=0.7)
    keep = pol.select(inp)
    assert torch.equal(keep, pol.select(inp))
    fresh = with_budget(build(h_kv=2, group=3, n=200, w=40, seed=7), 60)
    assert torch.equal(keep, NaCl(proxy=8, random_ratio=0.7).select(fresh))
    changes = ({"seed": torch.tensor([1])}, {"layer": 1}, {"head_offset": 2}, {"seq_len": torch.tensor([201])})
    for change in changes:
        other = pol.select(inp.evolve(**change))
        assert not torch.equal(keep[0, 0], other[0, 0]), change
        assert not torch.equal(keep[0, 1], other[0, 1]), change


def test_heads_draw_independently():
    inp = build(h_kv=4, group=2, n=200, w=40, seed=8, same_heads=True)
    pol = NaCl(proxy=8, random_ratio=0.7)
    part = pol.partition(with_budget(inp, 60))
    assert all(torch.equal(part.proxy_top[0, 0], part.proxy_top[0, h]) for h in range(4))  # same data, same top
    rand = [set(part.random[0, h].nonzero().flatten().tolist()) for h in range(4)]
    assert all(len(r) == 48 - 14 for r in rand)  # rest 60 - 12, top round(0.3 * 48)
    assert len({frozenset(r) for r in rand}) == 4


def positions_only(heads: int, n: int, seed: int = 0, layer: int = 0, head_offset: int = 0,
                   seq_len: int | None = None) -> EvictionInputs:
    """Inputs whose K/V must never be read (the noise depends on keys of the draw only)."""
    def unread() -> torch.Tensor:
        raise AssertionError("the noise must not read K or V")

    return EvictionInputs(keys=Deferred(unread), values=Deferred(unread),
                          positions=torch.arange(n).expand(1, heads, n), lengths=torch.tensor([n]),
                          queries=torch.zeros(1, heads, 0, 4), query_positions=torch.zeros(1, 0, dtype=torch.int64),
                          scale=1.0, seq_len=torch.tensor([n if seq_len is None else seq_len]),
                          num_new=torch.tensor([1]), layer=layer, seed=torch.tensor([seed]), head_offset=head_offset)


def test_noise_streams():
    a = gumbel_noise(positions_only(3, 1000))
    assert a.shape == (1, 3, 1000) and a.dtype == torch.float32
    assert torch.equal(a, gumbel_noise(positions_only(3, 1000)))
    assert torch.isfinite(a).all()
    # Every (seed, layer, global head) gets its own draws.
    draws = {gumbel_noise(positions_only(1, 64, seed=s, layer=l, head_offset=h))[0, 0, :8].tolist().__repr__()
             for s in range(3) for l in range(3) for h in range(3)}
    assert len(draws) == 27
    # A separate stream from the random policy's (same keys otherwise).
    inp = positions_only(2, 500, seq_len=1000)  # the same keys as a's first heads and slots
    assert not torch.equal(head_draws(inp), head_draws(inp, GUMBEL_STREAM))
    assert torch.equal(a[:, :2, :500], -torch.log(-torch.log(head_draws(inp, GUMBEL_STREAM))))
    # The largest uniform draw stays below 1, so the noise stays finite (these keys hit it, see test_dense).
    top = positions_only(1, 231, seq_len=11738)
    assert torch.isfinite(gumbel_noise(top)).all() and float(gumbel_noise(top)[0, 0, 230]) > 16
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance pi^2 / 6
    big = gumbel_noise(positions_only(4, 50_000, seed=123))
    assert abs(float(big.mean()) - 0.5772) < 0.02
    assert abs(float(big.var()) - math.pi ** 2 / 6) < 0.05


def _inclusion_counts(pol, budget, n, trials):
    """How often each slot is drawn over ``trials`` seeds: one batch of ``trials`` copies of a request
    that differ in their seed only (draws do not depend on the batch, see test_batched.py)."""
    one = build(h_kv=1, group=1, n=n, w=4, seed=0)
    rows = lambda x: x.expand(trials, *x.shape[1:])  # noqa: E731
    inp = one.evolve(keys=rows(one.keys), values=rows(one.values), positions=rows(one.positions),
                     lengths=rows(one.lengths), queries=rows(one.queries), query_positions=rows(one.query_positions),
                     seq_len=rows(one.seq_len), num_new=rows(one.num_new), seed=torch.arange(trials))
    drawn = pol.partition(with_budget(inp, budget)).random[:, 0]  # [trials, n]
    return drawn.float().mean(dim=0)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_single_draw_follows_softmax_of_score(temperature):
    # 10 candidates + a protected tail of 2; budget 3 leaves exactly one random draw
    f = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.2, 0.0, 1.5, 0.0, 9.0, 9.0])
    pol = fixed(f, proxy=2, sinks=0, random_ratio=1.0, temperature=temperature)
    trials = 3000
    freq = _inclusion_counts(pol, 3, 12, trials)
    p = torch.softmax(f[:10] / temperature, 0)
    tol = 5 * torch.sqrt(p * (1 - p) / trials) + 2e-3
    assert torch.all((freq[:10] - p).abs() <= tol), (freq[:10], p)
    assert float(freq[10:].sum()) == 0.0  # protected tokens are never "drawn"


def test_draws_are_without_replacement_with_exact_inclusion_probabilities():
    f = torch.tensor([2.5, 1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 7.0, 7.0])
    pol = fixed(f, proxy=2, sinks=0, random_ratio=1.0)
    trials = 3000
    freq = _inclusion_counts(pol, 4, 10, trials)  # two draws from 8 candidates
    p = torch.softmax(f[:8].double(), 0)
    # P(j in a 2-sample without replacement) = p_j + sum_{i != j} p_i p_j / (1 - p_i)
    incl = torch.stack([p[j] + sum(p[i] * p[j] / (1 - p[i]) for i in range(8) if i != j) for j in range(8)])
    assert float(incl.sum()) == pytest.approx(2.0)
    tol = 5 * torch.sqrt(incl * (1 - incl) / trials) + 2e-3
    assert torch.all((freq[:8].double() - incl).abs() <= tol), (freq[:8], incl)
    assert float(freq[:8].sum()) == pytest.approx(2.0)  # exactly two distinct tokens each time


def test_high_score_token_kept_far_more_often():
    f = torch.zeros(40)
    f[5], f[30] = 3.0, 0.1
    pol = fixed(f, proxy=4, sinks=0, random_ratio=1.0)
    freq = _inclusion_counts(pol, 7, 40, 600)  # 3 draws from 36 candidates
    assert float(freq[5]) > 0.3  # P ~ 0.56
    assert float(freq[30]) < 0.2  # P ~ 0.09
    assert float(freq[5]) > 3 * float(freq[30])


# ---- contract and options ---------------------------------------------------------------------------
def test_class_contract():
    pol = EvictionConfig.from_spec("nacl", 200).build_policy()
    assert isinstance(pol, NaCl) and pol.one_shot and pol.is_attention_mass
    assert pol.options == {"proxy": None, "sinks": 4, "random_ratio": 7 / 19, "temperature": 1.0}
    assert pol.protected_count(200) == 4 + 32
    assert pol.protected_count(40) == 4 + 18  # the default's cap: half the non-sink budget
    assert NaCl(proxy=20).protected_count(200) == 24
    assert EvictionConfig.from_spec("nacl", 200).schedule == "oneshot"
    inp = build(n=100, w=40)
    scores = pol.scores(inp)[0]
    assert torch.isinf(scores[:, -32:]).all() and torch.isinf(scores[:, :4]).all()
    assert torch.isfinite(scores[:, 4:-32]).all()


@pytest.mark.parametrize("budget,options,match", [
    (100, {"proxy": 0}, r"proxy must be an integer in \[1, 2147483647\]"),
    (100, {"proxy": -4}, r"proxy must be an integer in \[1, 2147483647\]"),
    (100, {"proxy": 2.5}, r"proxy must be an integer in \[1, 2147483647\]"),
    (100, {"sinks": -1}, r"sinks must be an integer in \[0, 2147483647\]"),
    (100, {"random_ratio": -0.1}, r"random_ratio must be a number in \[0, 1\], got -0.1"),
    (100, {"random_ratio": 1.5}, r"random_ratio must be a number in \[0, 1\], got 1.5"),
    (100, {"random_ratio": "half"}, r"random_ratio must be a number"),
    (100, {"temperature": 0.0}, r"temperature must be a number in \[0.0001, 10000\], got 0.0"),
    (100, {"temperature": -1}, r"temperature must be a number in \[0.0001, 10000\], got -1"),
    (64, {"proxy": 60}, r"budget 64 must be larger than the 64 tokens nacl always keeps"),
    (4, {}, r"budget 4 must be larger than the 4 tokens nacl always keeps"),
    (5, {}, r"budget 5 leaves no proxy query for nacl"),
    (100, {"recent": 8}, r"unknown option 'recent' for nacl"),
])
def test_invalid_options(budget, options, match):
    with pytest.raises(ValueError, match=match):
        EvictionConfig.from_spec("nacl", budget, **options)


def test_smallest_valid_budget():
    cfg = EvictionConfig.from_spec("nacl", 6)  # one proxy, one selected token
    inp = build(h_kv=1, group=1, n=30, w=10)
    part = cfg.build_policy().partition(with_budget(inp, 6))
    assert int(part.protected.sum()) == 5 and int(part.proxy_top.sum() + part.random.sum()) == 1


def test_query_ring_is_as_wide_as_the_default_can_reach_at_the_budget():
    """The engine buffers window_for(budget) queries per request: the default n_p is at most
    min(32, floor((B - sinks) / 2)), so that is the width."""
    nacl = EvictionConfig.from_spec("nacl", budget=40).build_policy()
    assert nacl.window_for(40) == (40 - 4) // 2
    assert nacl.window_for(10_000) == NaCl.DEFAULT_PROXY
    assert nacl.window_for(None) == NaCl.DEFAULT_PROXY == nacl.query_window
    fixed = EvictionConfig.from_spec("nacl", budget=96, proxy=8).build_policy()
    assert fixed.window_for(96) == fixed.window_for(None) == 8
    snapkv = EvictionConfig.from_spec("snapkv", budget=96).build_policy()
    assert snapkv.window_for(96) == snapkv.query_window


def test_default_never_needs_more_queries_than_the_ring_holds():
    nacl = NaCl()
    for budget in (9, 40, 96, 300, 2052, 5000):
        for length in (16, 500, 4000, 100_000):
            inp = build(h_kv=1, group=1, n=20, w=64, positions=list(range(length - 20, length)))
            assert int(nacl.proxy_count(with_budget(inp, budget))[0]) <= nacl.window_for(budget)
