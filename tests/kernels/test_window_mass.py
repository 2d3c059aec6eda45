"""window_mass on every backend against paged.window_mass (dense.window_mass over the gathered keys):
padded windows with empty entries, rows of different lengths with width > every length, per-row
gains, int32 positions after a permutation, GQA groups, per query head, every cache layout."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import dense, ops, paged

from kernel_cases import (FORBIDDEN_OPS, TOL, OpLog, assert_same_keep, block_table, make_kv, pages_needed,
                          positions_buffer)

PAGE = 16
LENGTHS = (75, 40, 17, 0)  # the last row holds nothing yet
ENTRIES = (8, 5, 1, 3)  # live window entries per row; the rest of W are empty (-1)


def _case(device, dtype, group, d, *, heads=2, lengths=LENGTHS, entries=ENTRIES, window=8, width=96,
          layout="nhd", seed=0, gain=False, position_dtype=torch.int64):
    """A padded window of ``window`` entries per row: row r's live entries are its newest
    ``entries[r]`` positions, stored in ring order (rotated), the other entries empty."""
    n_pages = pages_needed(list(lengths), PAGE) + 2
    k, _ = make_kv(n_pages, heads, PAGE, d, dtype, layout, device, seed=seed)
    table = block_table(list(lengths), PAGE, n_pages, device, seed=seed)
    pos = positions_buffer(n_pages, heads, PAGE, table, list(lengths), device, seed)
    g = torch.Generator().manual_seed(seed + 7)
    rows = len(lengths)
    qpos = torch.full((rows, window), dense.EMPTY_QUERY, dtype=torch.int64)
    for r, (n, e) in enumerate(zip(lengths, entries)):
        live = torch.arange(2 * n - e, 2 * n) if n else torch.arange(e)  # positions go up to 2n - 1
        qpos[r, :e] = live
        qpos[r] = qpos[r].roll(r)  # a ring buffer: entries in any order
    queries = (torch.randn(rows, window, heads * group, d, generator=g) * 1.5).to(dtype).to(device)
    gains = (torch.rand(rows, window, generator=g) * 2 + 0.3).to(device) if gain else None
    return dict(k_cache=k, block_table=table, lengths=torch.tensor(lengths, device=device), queries=queries,
                query_positions=qpos.to(position_dtype).to(device), scale=d ** -0.5, positions=pos, width=width,
                gain=gains)


def _check(out, ref, case, dtype, group):
    tol = TOL[dtype]
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * 1e-2)
    lengths = case["lengths"]
    pad = ~dense.valid_slots(lengths, case["width"])
    if out.dim() == 4:
        pad = pad.unsqueeze(1)
    assert (out.masked_select(pad) == 0).all(), "padding slots must hold exactly 0"
    # Every entry that sees a key spreads one unit of mass per query head.
    seeing = ((case["query_positions"] >= 0) & (lengths.view(-1, 1) > 0)).sum(dim=1).float()
    total = out.sum(dim=-1) if out.dim() == 3 else out.sum(dim=(-2, -1))
    torch.testing.assert_close(total, seeing.view(-1, 1).expand_as(total) * group, rtol=1e-3, atol=1e-3)
    assert_same_keep(out, ref, lengths, budget=12, rtol=tol)


@pytest.mark.parametrize("group,dtype,layout", [
    (1, torch.float32, "nhd"), (3, torch.bfloat16, "cpu"), (7, torch.float16, "hnd"), (3, torch.float32, "cpu")])
def test_window_mass(device, backend, group, dtype, layout):
    case = _case(device, dtype, group, 64, layout=layout, seed=group)
    out = ops.window_mass(**case, backend=backend)
    ref = paged.window_mass(**case)
    assert ref[:3].abs().sum() > 0
    _check(out, ref, case, dtype, group)


@pytest.mark.parametrize("per_query_head", [False, True])
def test_window_mass_gain_and_int32_query_positions(device, backend, per_query_head):
    """AhaKV's per-row, per-entry gain [R, W]; int32 query positions; one query head per output."""
    if backend == "cuda" and per_query_head:
        pytest.skip("the CUDA kernel sums over the group (ops falls back to Triton per query head)")
    case = _case(device, torch.bfloat16, 3, 32, layout="hnd", seed=11, gain=True, position_dtype=torch.int32)
    out = ops.window_mass(**case, per_query_head=per_query_head, backend=backend)
    ref = paged.window_mass(**case, per_query_head=per_query_head)
    assert out.shape == ((4, 2, 3, 96) if per_query_head else (4, 2, 96))
    _check(out, ref, case, torch.bfloat16, 3)
    plain = paged.window_mass(**{**case, "gain": None}, per_query_head=per_query_head)
    assert not torch.allclose(ref, plain, atol=1e-3), "the gain must change the mass"


def test_window_mass_matches_a_per_query_softmax(device):
    """The reference itself, checked once against one softmax per (row, head, entry) in plain torch."""
    case = _case(device, torch.float32, 2, 16, lengths=(30, 12), entries=(4, 2), window=5, width=40, seed=4,
                 gain=True)
    out = ops.window_mass(**case, per_query_head=True, backend="triton" if device.type == "cpu" else None)
    pages, offsets = paged.slot_addresses(case["block_table"], case["width"], PAGE)
    keys = paged.gather_slots(case["k_cache"], pages, offsets).float()  # [R, H, N, d]
    kpos = paged.gather_slots(case["positions"], pages, offsets)
    expected = torch.zeros_like(out)
    for r, n in enumerate((30, 12)):
        for hq in range(4):
            h, g = divmod(hq, 2)
            for e in range(5):
                qp = case["query_positions"][r, e]
                seen = kpos[r, h, :n] <= qp
                if qp < 0 or not seen.any():
                    continue
                logits = keys[r, h, :n] @ case["queries"][r, e, hq].float() * case["scale"] * case["gain"][r, e]
                expected[r, h, g, :n] += torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=0)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-6)


def test_window_mass_tiles_and_empty_windows(device):
    """Tiny tiles make several key tiles and window tiles per row; a row whose window is all empty and
    a call with W = 0 give zeros."""
    from vllm_evict.kernels import window_mass as triton_window_mass

    # 3 key tiles and 2 window tiles per row (a GPU's tl.dot needs 16 rows or more: a longer window there)
    block_w, window = (4, 5) if device.type == "cpu" else (16, 20)
    case = _case(device, torch.float32, 2, 16, heads=1, lengths=(35, 20, 18), entries=(5, 0, 3), window=window,
                 width=40, seed=6)
    out = triton_window_mass.window_mass(**case, block_n=16, block_w=block_w)
    torch.testing.assert_close(out, paged.window_mass(**case), rtol=1e-4, atol=1e-6)
    assert (out[1] == 0).all()
    empty = {**case, "queries": case["queries"][:, :0], "query_positions": case["query_positions"][:, :0]}
    assert torch.equal(ops.window_mass(**empty, backend="triton"), torch.zeros(3, 1, 40, device=device))


def test_window_mass_rejects_bad_arguments(device):
    case = _case(device, torch.float32, 1, 16, lengths=(20,), entries=(2,), window=2, width=20)
    with pytest.raises(ValueError, match=r"query_positions must be \[R, W\] = \[1, 2\], got shape \(1, 3\)"):
        ops.window_mass(**{**case, "query_positions": torch.zeros(1, 3, dtype=torch.long, device=device)},
                        backend="triton")
    with pytest.raises(ValueError, match=r"gain must be None or \[R, W\] = \[1, 2\], got shape \(1,\)"):
        ops.window_mass(**{**case, "gain": torch.ones(1, device=device)}, backend="triton")
    with pytest.raises(TypeError, match="positions must be int32 or int64, got torch.float32"):
        ops.window_mass(**{**case, "positions": case["positions"].float()}, backend="triton")
    with pytest.raises(ValueError, match="3 query heads do not form groups over 2 KV heads"):
        bad = _case(device, torch.float32, 1, 16, heads=2, lengths=(20,), entries=(2,), window=2, width=20)
        ops.window_mass(**{**bad, "queries": torch.zeros(1, 2, 3, 16, device=device)}, backend="triton")


def test_window_mass_launcher_dispatches_no_sync(device):
    """The launcher allocates its result and LSE scratch and launches two kernels: no .item(), no
    tensor built from Python data, no conversion of an argument."""
    case = _case(device, torch.float32, 2, 16, lengths=(20, 9), entries=(2, 1), window=2, width=24, seed=8,
                 gain=True)
    ops.window_mass(**case, backend="triton")  # compile / warm up
    with OpLog() as log:
        ops.window_mass(**case, backend="triton")
    assert not set(log.ops) & set(FORBIDDEN_OPS), log.ops
    if device.type == "cuda":
        assert log.ops == {"aten.empty": 2}, log.ops


@pytest.mark.parametrize("group,dtype,layout,per_query_head,gain", [
    (1, torch.float32, "nhd", False, False), (3, torch.bfloat16, "cpu", False, True),
    (7, torch.float16, "hnd", False, False), (3, torch.float32, "cpu", True, True)])
def test_accumulate_window_mass_adds_into_the_paged_state(device, backend, group, dtype, layout, per_query_head,
                                                          gain):
    """The fused update (the engine's window mass, accumulated): the state at every row's slots grows by
    exactly ``window_mass``, and no other slot of the state changes (padding included)."""
    if backend == "cuda" and per_query_head:
        pytest.skip("the CUDA kernel sums over the group (ops falls back to Triton per query head)")
    case = _case(device, dtype, group, 64, layout=layout, seed=group + 20, gain=gain)
    k = case["k_cache"]
    shape = (*k.shape[:3], group) if per_query_head else k.shape[:3]
    g = torch.Generator().manual_seed(5)
    before = (torch.rand(shape, generator=g) * 3).to(device)
    state = before.clone()
    ops.accumulate_window_mass(state, **case, backend=backend)
    mass = paged.window_mass(**case, per_query_head=per_query_head)  # [R, H, (G,) width]
    want = before.clone()
    lengths = case["lengths"].tolist()
    for r, n in enumerate(lengths):
        for slot in range(n):
            page = int(case["block_table"][r, slot // PAGE])
            add = mass[r, :, :, slot] if per_query_head else mass[r, :, slot]
            want[page, :, slot % PAGE] += add.to(want.device)
    tol = TOL[dtype]
    torch.testing.assert_close(state, want, rtol=tol, atol=tol * 1e-2)
    assert not torch.equal(state, before)
    touched = torch.zeros(shape[:1], dtype=torch.bool)
    for r, n in enumerate(lengths):
        for slot in range(n):
            touched[int(case["block_table"][r, slot // PAGE])] = True
    assert torch.equal(state[~touched.to(device)], before[~touched.to(device)]), "a page no row holds changed"
