"""compact_tokens on every backend: bit-exact against paged.compact_tokens, with per-row counts and the
sentinel columns of dense.topk_keep, on K/V views of every layout and the per-token buffers."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import dense, ops, paged

from kernel_cases import FORBIDDEN_OPS, LAYOUTS, NULL_PAGE, OpLog, block_table, make_kv, pages_needed

PAGE = 16
LENGTHS = [70, 37, 16, 0, 21]  # partial pages, a row with no tokens
COUNTS = [29, 37, 5, 0, 0]  # a pure shift, a row keeping everything, rows keeping nothing


def _keep(lengths, counts, heads, width, seed):
    """[R, H, max(counts)] kept slots from dense.topk_keep (sentinel ``width`` past each row's count);
    head 0 of row 0 keeps its newest slots, so every kept slot moves."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(len(lengths), heads, width, generator=g)
    scores[0, 0] = torch.arange(width, dtype=torch.float32)
    lens = torch.tensor(lengths)
    keep = dense.topk_keep(scores, dense.valid_slots(lens, width), torch.tensor(counts), max(counts))
    return keep


def _buffers(k, v, device):
    """K, V and the per-token buffers of the engine: int32 positions and an fp32 state."""
    g = torch.Generator().manual_seed(9)
    shape = k.shape[:3]
    state = torch.randn(shape, generator=g).to(device)
    positions = torch.randint(0, 1 << 20, shape, generator=g, dtype=torch.int32).to(device)
    return [k, v, positions, state]


def _check(buffers, reference):
    for got, want in zip(buffers, reference):
        # The reference sends the writes of dead columns to the null page; the kernels skip them.
        assert torch.equal(got[NULL_PAGE + 1:], want[NULL_PAGE + 1:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compact_matches_reference(device, backend, layout, dtype):
    heads, d, width = 3, 32, 80  # width > every length: sentinel columns hold 80
    n_pages = pages_needed(LENGTHS, PAGE)
    table = block_table(LENGTHS, PAGE, n_pages, device)
    k, v = make_kv(n_pages, heads, PAGE, d, dtype, layout, device)
    buffers = _buffers(k, v, device)
    keep = _keep(LENGTHS, COUNTS, heads, width, seed=1).to(device)
    assert (keep[1:, :, 5:] == width).any(), "the case must hold sentinel columns"
    counts = torch.tensor(COUNTS, device=device)
    reference = [t.clone() for t in buffers]  # K and V never overlap, so separate clones are exact
    paged.compact_tokens(reference, table, keep, counts)
    before = [t.clone() for t in buffers]
    ops.compact_tokens(buffers, table, keep, counts, backend=backend)
    assert not torch.equal(buffers[0], before[0]), "the case must move data"
    _check(buffers, reference)
    if backend != "torch":
        for got, old in zip(buffers, before):
            assert torch.equal(got[NULL_PAGE], old[NULL_PAGE]), "a kernel wrote to the null page"


def test_compact_index_dtypes_and_strided_keep(device, kernel_backend):
    """int64 block table, int32 keep read through a non-contiguous view, int32 counts; counts past
    the keep width are clamped to it (no column beyond keep is read). The reference gets keep as
    dense.topk_keep makes it (int64, contiguous)."""
    backend = kernel_backend
    heads, d, width = 2, 16, 40
    lengths, counts = [33, 40], [12, 40]
    n_pages = pages_needed(lengths, PAGE)
    table = block_table(lengths, PAGE, n_pages, device, seed=3, dtype=torch.int64)
    k, v = make_kv(n_pages, heads, PAGE, d, torch.float32, "cpu", device, seed=3)
    keep64 = _keep(lengths, counts, heads, width, seed=4)
    keep = keep64.int().transpose(0, 1).contiguous().transpose(0, 1).to(device)  # strides (b, R*b, 1)
    assert not keep.is_contiguous()
    reference = [k.clone(), v.clone()]
    paged.compact_tokens(reference, table, keep64.to(device), torch.tensor(counts, device=device))
    ops.compact_tokens([k, v], table, keep, torch.tensor(counts, dtype=torch.int32, device=device), backend=backend)
    _check([k, v], reference)
    k2, v2 = make_kv(n_pages, heads, PAGE, d, torch.float32, "cpu", device, seed=3)
    ops.compact_tokens([k2, v2], table, keep, torch.tensor([12, 99], device=device), backend=backend)
    _check([k2, v2], reference)


def test_compact_rejects_bad_arguments(device):
    k, v = make_kv(4, 2, PAGE, 16, torch.float32, "hnd", device)
    table = torch.tensor([[1, 2]], device=device)
    keep = torch.tensor([[[0, 3], [1, 2]]], device=device)
    with pytest.raises(TypeError, match="keep must be int32 or int64, got torch.float32"):
        ops.compact_tokens([k, v], table, keep.float(), torch.tensor([2], device=device), backend="triton")
    with pytest.raises(ValueError, match=r"counts must be \[R\] with R = 1"):
        ops.compact_tokens([k, v], table, keep, torch.tensor([2, 2], device=device), backend="triton")
    with pytest.raises(ValueError, match="keep has 2 heads, a cache has 3"):
        k3, _ = make_kv(4, 3, PAGE, 16, torch.float32, "hnd", device)
        ops.compact_tokens([k3], table, keep, torch.tensor([2], device=device), backend="triton")


def test_compact_launcher_dispatches_nothing(device):
    """No host-device sync, no argument copy: the launcher only launches kernels (one per cache)."""
    heads, d, width = 1, 16, 24
    lengths, counts = [20, 7], [12, 5]
    n_pages = pages_needed(lengths, PAGE)
    table = block_table(lengths, PAGE, n_pages, device)
    k, v = make_kv(n_pages, heads, PAGE, d, torch.float32, "nhd", device)
    keep = _keep(lengths, counts, heads, width, seed=5).to(device)
    cnt = torch.tensor(counts, device=device)
    ops.compact_tokens([k, v], table, keep, cnt, backend="triton")  # compile / warm up
    with OpLog() as log:
        ops.compact_tokens([k, v], table, keep, cnt, backend="triton")
    assert not set(log.ops) & set(FORBIDDEN_OPS), log.ops
    if device.type == "cuda":
        assert not log.ops, log.ops
