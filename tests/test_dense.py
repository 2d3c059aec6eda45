"""vllm_evict.dense, the reference math every policy, paged reference and kernel test builds on, against
naive loops written straight from the definitions: padded rows (junk in the padding), empty window
entries, per-row gains and counts, shuffled logical positions."""

from __future__ import annotations

import itertools
import math
import re
from typing import Iterator

import pytest
import torch

from vllm_evict import dense

LENGTHS = [9, 4, 0, 7]  # a row that holds nothing yet
WIDTH = 11
H, G, D = 2, 3, 8


@pytest.fixture(autouse=True, scope="module")
def dense_tests_on_one_thread(one_intra_op_thread: None) -> Iterator[None]:
    yield


def padded_case(seed: int = 0, window: int = 5):
    """Rows of LENGTHS candidates in WIDTH slots (junk beyond), shuffled increasing positions with gaps,
    and a window per row in ring order with empty entries (-1)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    keys = torch.randn(rows, H, WIDTH, D, generator=g) * 1.3
    values = torch.randn(rows, H, WIDTH, D, generator=g)
    positions = torch.randint(-5, 500, (rows, H, WIDTH), generator=g)  # junk, overwritten for real slots
    qpos = torch.full((rows, window), -1, dtype=torch.int64)
    for r, n in enumerate(LENGTHS):
        for h in range(H):
            chosen = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
            positions[r, h, :n] = chosen[torch.randperm(n, generator=g)]
        live = min(window - 1, max(n, 1))
        newest = 2 * n  # above every key position: the newest query sees all
        qpos[r, :live] = torch.arange(newest - live + 1, newest + 1)
        qpos[r] = qpos[r].roll(r)
    if LENGTHS[0]:
        qpos[0, qpos[0] >= 0] -= torch.arange(int((qpos[0] >= 0).sum())) * 3  # older queries see fewer keys
    queries = torch.randn(rows, H * G, window, D, generator=g) * 1.3
    return keys, values, positions, torch.tensor(LENGTHS), queries, qpos


# ---- padding helpers -------------------------------------------------------------------------------
def test_valid_slots_and_as_rows():
    valid = dense.valid_slots(torch.tensor([2, 0, 3]), 3)
    assert valid.tolist() == [[[True, True, False]], [[False] * 3], [[True] * 3]]
    assert dense.as_rows(5, 3, torch.device("cpu"), torch.int64).tolist() == [5, 5, 5]
    assert dense.as_rows(torch.tensor([1, 2]), 2, torch.device("cpu"), torch.float32).tolist() == [1.0, 2.0]


def test_row_gains_shapes():
    assert torch.equal(dense.row_gains(None, 2, 3, torch.device("cpu")), torch.ones(2, 3))
    assert torch.equal(dense.row_gains(2.0, 2, 3, torch.device("cpu")), torch.full((2, 3), 2.0))
    assert dense.row_gains(torch.tensor([1.0, 3.0]), 2, 3, torch.device("cpu")).tolist() == [[1.0] * 3, [3.0] * 3]
    per_entry = torch.rand(2, 3)
    assert torch.equal(dense.row_gains(per_entry, 2, 3, torch.device("cpu")), per_entry)


def test_latest_queries():
    qpos = torch.tensor([[7, 8, 5, 6, -1], [3, -1, 1, 2, 0]])
    seq_len = torch.tensor([9, 4])
    assert dense.latest_queries(qpos, seq_len, 2).tolist() == [[7, 8, -1, -1, -1], [3, -1, -1, 2, -1]]
    assert dense.latest_queries(qpos, seq_len, torch.tensor([1, 4])).tolist() == [[-1, 8, -1, -1, -1],
                                                                                   [3, -1, 1, 2, 0]]
    assert (dense.latest_queries(qpos, seq_len, 0) == -1).all()


# ---- window mass -----------------------------------------------------------------------------------
def naive_window_mass(keys, positions, lengths, queries, qpos, scale, gains) -> torch.Tensor:
    """[R, H, G, N] float64: for every live window entry, softmax of gain*scale*q.k over the row's real
    keys at positions <= the entry's position; 0 on padding."""
    rows, heads, width, _ = keys.shape
    group = queries.shape[1] // heads
    out = torch.zeros(rows, heads, group, width, dtype=torch.float64)
    for r in range(rows):
        for h in range(heads):
            for g in range(group):
                for i in range(queries.shape[2]):
                    p = int(qpos[r, i])
                    visible = [j for j in range(int(lengths[r])) if p >= 0 and int(positions[r, h, j]) <= p]
                    if not visible:
                        continue
                    q = queries[r, h * group + g, i].double()
                    z = torch.stack([float(gains[r, i]) * scale * (q @ keys[r, h, j].double()) for j in visible])
                    for j, a in zip(visible, torch.softmax(z, dim=0)):
                        out[r, h, g, j] += a
    return out


@pytest.mark.parametrize("gain", ["none", "scalar", "row", "entry"])
def test_window_mass_equals_naive(gain):
    keys, _, positions, lengths, queries, qpos = padded_case(seed=1)
    rows, w = qpos.shape
    g = torch.Generator().manual_seed(9)
    gains = {"none": None, "scalar": 1.7, "row": torch.rand(rows, generator=g) * 2 + 0.2,
             "entry": torch.rand(rows, w, generator=g) * 2 + 0.2}[gain]
    expected = naive_window_mass(keys, positions, lengths, queries, qpos, D ** -0.5,
                                 dense.row_gains(gains, rows, w, torch.device("cpu")))
    per_head = dense.window_mass(keys, positions, lengths, queries, qpos, D ** -0.5, gain=gains, per_query_head=True)
    summed = dense.window_mass(keys, positions, lengths, queries, qpos, D ** -0.5, gain=gains)
    assert per_head.shape == (rows, H, G, WIDTH) and summed.shape == (rows, H, WIDTH)
    assert per_head.dtype == torch.float32
    torch.testing.assert_close(per_head.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(summed, per_head.sum(dim=2))
    pad = ~dense.valid_slots(lengths, WIDTH)
    assert (summed.masked_select(pad) == 0).all()
    # Every live entry that sees a key spreads one unit per query head; the empty row gets nothing.
    assert summed[2].abs().sum() == 0


def test_window_mass_query_blocks(monkeypatch):
    """A long window goes through in blocks of queries: the same sums as all at once."""
    keys, _, positions, lengths, queries, qpos = padded_case(seed=2, window=7)
    gains = torch.rand(4, 7, generator=torch.Generator().manual_seed(0)) + 0.5
    whole = dense.window_mass(keys, positions, lengths, queries, qpos, 0.4, gain=gains, per_query_head=True)
    monkeypatch.setattr(dense, "_QUERY_BLOCK", 3)  # blocks of 3, 3 and 1
    blocked = dense.window_mass(keys, positions, lengths, queries, qpos, 0.4, gain=gains, per_query_head=True)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-7)


def test_window_mass_empty_shapes():
    keys = torch.randn(2, H, 5, D)
    out = dense.window_mass(keys, torch.zeros(2, H, 5, dtype=torch.int64), torch.tensor([5, 3]),
                            torch.randn(2, H * G, 0, D), torch.zeros(2, 0, dtype=torch.int64), 1.0)
    assert out.shape == (2, H, 5) and (out == 0).all()


# ---- KeyDiff -----------------------------------------------------------------------------------------
def test_keydiff_scores_equal_naive():
    keys, _, _, lengths, _, _ = padded_case(seed=3)
    keys[0, 1, 2] = 0.0  # a zero key: k̂ = 0, score exactly 0
    got = dense.keydiff_scores(keys, lengths)
    assert got.shape == (4, H, WIDTH) and got.dtype == torch.float32
    for r, n in enumerate(LENGTHS):
        assert torch.isneginf(got[r, :, n:]).all()
        if n == 0:
            continue
        k = keys[r, :, :n].double()
        khat = k / k.norm(dim=-1, keepdim=True).clamp_min(dense.KEY_NORM_EPS)
        expected = -(khat * khat.mean(dim=1, keepdim=True)).sum(dim=-1)
        torch.testing.assert_close(got[r, :, :n].double(), expected, rtol=1e-5, atol=1e-7)
    assert got[0, 1, 2] == 0


# ---- CAOTE -------------------------------------------------------------------------------------------
def test_normalise_mass():
    valid = dense.valid_slots(torch.tensor([3, 2, 0]), 4)
    mass = torch.tensor([[[1.0, 3.0, 0.0, 99.0]], [[0.0, 0.0, 5.0, 5.0]], [[1.0, 1.0, 1.0, 1.0]]])
    alpha = dense.normalise_mass(mass, valid)
    torch.testing.assert_close(alpha, torch.tensor([[[0.25, 0.75, 0.0, 0.0]], [[0.5, 0.5, 0.0, 0.0]],
                                                    [[0.0, 0.0, 0.0, 0.0]]]))
    # a tiny negative (rounding) counts as 0
    assert dense.normalise_mass(torch.tensor([[[-1e-9, 2.0]]]), dense.valid_slots(torch.tensor([2]), 2)).tolist() == \
        [[[0.0, 1.0]]]


@pytest.mark.parametrize("fast", [False, True])
def test_output_error_equals_naive(fast):
    _, values, _, lengths, _, _ = padded_case(seed=4)
    g = torch.Generator().manual_seed(5)
    alpha = dense.normalise_mass(torch.rand(4, H, WIDTH, generator=g) ** 3, dense.valid_slots(lengths, WIDTH))
    alpha[3, 0, :7] = 0.0
    alpha[3, 0, 2] = 1.0  # 1 - alpha < eps: +inf
    got = dense.output_error(alpha, values, lengths, fast=fast, eps=1e-6)
    assert got.shape == (4, H, WIDTH)
    for r, n in enumerate(LENGTHS):
        assert torch.isneginf(got[r, :, n:]).all()
        for h in range(H):
            v = values[r, h, :n].double()
            a = alpha[r, h, :n].double()
            x = v.mean(dim=0) if fast else (a.unsqueeze(-1) * v).sum(dim=0)
            for j in range(n):
                if 1 - a[j] < 1e-6:
                    assert got[r, h, j] == float("inf")
                else:
                    want = a[j] / (1 - a[j]) * torch.linalg.vector_norm(x - v[j])
                    torch.testing.assert_close(got[r, h, j].double(), want, rtol=1e-5, atol=1e-7)


def test_output_error_from_center_per_query_head():
    """Head mode: alpha and X per query head [R, H, G, *], the values shared by the group."""
    g = torch.Generator().manual_seed(6)
    alpha = torch.softmax(torch.randn(2, H, G, 5, generator=g), dim=-1)
    values = torch.randn(2, H, 5, D, generator=g)
    center = torch.einsum("rhgn,rhnd->rhgd", alpha, values)
    got = dense.output_error_from_center(alpha, values, center, 1e-6)
    for r in range(2):
        for h in range(H):
            for q in range(G):
                for j in range(5):
                    want = alpha[r, h, q, j] / (1 - alpha[r, h, q, j]) * torch.linalg.vector_norm(
                        center[r, h, q] - values[r, h, j])
                    torch.testing.assert_close(got[r, h, q, j], want, rtol=1e-5, atol=1e-7)


# ---- masks, pooling, selection -----------------------------------------------------------------------
def test_recent_and_sink_masks_ignore_padding():
    positions = torch.tensor([[[5, 1, 9, 7, 900, -3]], [[2, 0, 1, 800, 800, 800]]])
    valid = dense.valid_slots(torch.tensor([4, 3]), 6)
    # The last ``count`` logical positions of each row (9 and 8 in row 0, of which only 9 is cached; 2 in
    # row 1), whatever the junk in the padding.
    recent = dense.recent_mask(positions, valid, torch.tensor([2, 1]))
    assert recent.tolist() == [[[False, False, True, False, False, False]], [[True, False, False, False, False, False]]]
    assert dense.recent_mask(positions, valid, 5)[0].tolist() == [[True, False, True, True, False, False]]
    assert not dense.recent_mask(positions, valid, 0).any()
    assert dense.sink_mask(positions, valid, 2).tolist() == [[[False, True, False, False, False, False]],
                                                            [[False, True, True, False, False, False]]]


def test_order_by_position_puts_padding_last():
    positions = torch.tensor([[[5, 1, 9, -1, 0]]])
    order = dense.order_by_position(positions, dense.valid_slots(torch.tensor([3]), 5))
    assert order.tolist() == [[[1, 0, 2, 3, 4]]]


def naive_pool_rows(x, positions, lengths, kernel, kind, count_pad=True):
    """Per (row, head, *) pool of the real slots along the logical order (zero/-inf edges)."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for r, n in enumerate(lengths.tolist()):
        for h in range(x.shape[1]):
            order = sorted(range(n), key=lambda j: int(positions[r, h, j]))
            for index in itertools.product(*[range(s) for s in x.shape[2:-1]]):  # the query heads, if any
                idx = (r, h, *index)
                for t, j in enumerate(order):
                    span = range(max(0, t - kernel // 2), min(n, t + kernel // 2 + 1))
                    near = [float(x[idx][order[u]]) for u in span]
                    if kind == "max":
                        out[idx][j] = max(near)
                    else:
                        out[idx][j] = sum(near) / (kernel if count_pad else len(near))
    return out


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("per_query_head", [False, True])
def test_pool_in_position_order_equals_naive(kind, per_query_head):
    _, _, positions, lengths, _, _ = padded_case(seed=7)
    g = torch.Generator().manual_seed(8)
    shape = (4, H, G, WIDTH) if per_query_head else (4, H, WIDTH)
    x = torch.rand(*shape, generator=g) * 1e3  # junk in the padding, too
    valid = dense.valid_slots(lengths, WIDTH)
    got = dense.pool_in_position_order(x, positions, valid, 5, kind)
    expected = naive_pool_rows(x, positions, lengths, 5, kind)
    for r, n in enumerate(LENGTHS):
        torch.testing.assert_close(got[r, ..., :n].double(), expected[r, ..., :n], rtol=1e-6, atol=1e-6)
    assert torch.equal(dense.pool_in_position_order(x, positions, valid, 5, "none"), x)
    assert torch.equal(dense.pool_in_position_order(x, positions, valid, 1, kind), x)


def test_pool_rejects_unknown_kind():
    x = torch.zeros(1, 1, 3)
    with pytest.raises(ValueError, match=re.escape("unknown pooling 'mean'; choose avg, max or none")):
        dense.pool_in_position_order(x, torch.zeros(1, 1, 3, dtype=torch.int64), torch.ones(1, 1, 3, dtype=torch.bool),
                                     3, "mean")


def test_mean_pool_in_position_order_counts_only_real_neighbours():
    _, _, positions, lengths, _, _ = padded_case(seed=9)
    x = torch.rand(4, H, WIDTH, generator=torch.Generator().manual_seed(1)) * 1e3
    valid = dense.valid_slots(lengths, WIDTH)
    got = dense.mean_pool_in_position_order(x, positions, valid, 5)
    expected = naive_pool_rows(x, positions, lengths, 5, "avg", count_pad=False)
    for r, n in enumerate(LENGTHS):
        torch.testing.assert_close(got[r, :, :n].double(), expected[r, :, :n], rtol=1e-6, atol=1e-6)
        assert (got[r, :, n:] == 0).all()


def test_protect_and_rank_descending():
    scores = torch.tensor([[[0.5, 2.0, 0.5, -1.0]]])
    assert dense.protect(scores, torch.tensor([[[False, False, True, False]]])).tolist() == \
        [[[0.5, 2.0, math.inf, -1.0]]]
    assert dense.rank_descending(scores).tolist() == [[[1, 0, 2, 3]]]  # a tie ranks the lower slot first


def test_topk_keep_layout_ties_nan_and_padding():
    scores = torch.tensor([
        [[3.0, 1.0, 3.0, float("nan"), 2.0, float("inf")]],  # 5 real slots, +inf padding
        [[-math.inf, 5.0, -math.inf, 7.0, 7.0, 7.0]],  # 3 real slots: keeps all, -inf included
        [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0]],
    ])
    valid = dense.valid_slots(torch.tensor([5, 3, 6]), 6)
    keep = dense.topk_keep(scores, valid, torch.tensor([3, 3, 2]), 3)
    assert keep.dtype == torch.int64 and keep.shape == (3, 1, 3)
    assert keep.tolist() == [[[0, 2, 4]],  # ties: both 3.0 kept; NaN ranks lowest; padding never
                             [[0, 1, 2]],  # a row keeping all its tokens keeps exactly its slots
                             [[0, 1, 6]]]  # equal scores: the lowest slots; beyond budget[r]: N
    keep_nan = dense.topk_keep(scores[:1], valid[:1], torch.tensor([5]), 5)
    assert keep_nan.tolist() == [[[0, 1, 2, 3, 4]]]


# ---- counter-based random numbers --------------------------------------------------------------------
M32 = 0xFFFFFFFF


def mix32_reference(x: int) -> int:
    """The avalanche mixer dense._mix32 documents, in Python integers (no overflow to worry about)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform_reference(*keys: int) -> float:
    """The draw: the centre of the hash's top-23-bit bucket, (k + 0.5) / 2^23, exact in fp32."""
    h = 0
    for key in keys:
        for part in (key & M32, (key >> 32) & M32):
            h = mix32_reference(h ^ part)
    return ((h >> 9) + 0.5) / float(1 << 23)


def test_uniform_hash_equals_a_python_reference():
    """Every multiplication is done in 16-bit halves in int64; big-integer Python gives the true value."""
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2 ** 62, (6,), generator=g)  # 64-bit seeds: both halves are used
    positions = torch.randint(0, 2 ** 31 - 1, (6,), generator=g)
    got = dense.uniform_hash(seeds.view(-1, 1), 3, torch.tensor([0, 1, 7]).view(1, -1), 1000, positions.view(-1, 1))
    assert got.shape == (6, 3) and got.dtype == torch.float32
    for i in range(6):
        for j, head in enumerate([0, 1, 7]):
            assert float(got[i, j]) == uniform_reference(int(seeds[i]), 3, head, 1000, int(positions[i]))
    assert dense.uniform_hash(2 ** 32 + 5, 1) != dense.uniform_hash(5, 1)  # the high half counts


def test_uniform_hash_never_reaches_one():
    """These keys hash to all-ones top bits: a 24-bit draw (2^24 - 0.5) / 2^24 rounded to 1.0 in fp32 there
    (a Gumbel draw of +inf for NaCl's stream 1 of seed 0 at length 11738, position 230). Found by search."""
    top = dense.uniform_hash(0, 0, 0, 11738, 230, 1)
    assert float(top) == 1 - 2 ** -24
    assert float(dense.uniform_hash(0, 0, 0, 1000, 2319630, 1)) == 1 - 2 ** -24


def test_uniform_hash_is_uniform_and_unrelated_across_neighbouring_keys():
    u = dense.uniform_hash(7, 2, torch.arange(4).view(4, 1), 1234, torch.arange(16384).view(1, -1))
    assert (u > 0).all() and (u < 1).all()
    # chi-square over 32 bins of 65536 draws: 31 degrees of freedom, 99.99th percentile ~ 70
    counts = torch.bincount((u.flatten() * 32).long(), minlength=32).double()
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
    assert chi2 < 70, chi2
    # neighbouring positions and neighbouring heads are uncorrelated (|r| ~ 1/sqrt(n) ~ 0.008)
    c = u - 0.5
    assert abs(float((c[:, 1:] * c[:, :-1]).mean() / c.var())) < 0.04
    assert abs(float((c[1:] * c[:-1]).mean() / c.var())) < 0.04
