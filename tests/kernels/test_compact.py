"""Compaction and gather kernels: bit-exact against paged.compact_tokens / gather_tokens."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import ops, paged

from kernel_cases import LAYOUTS, block_table, make_kv

BS = 16


def _keeps(lengths, counts, heads, width, seed):
    g = torch.Generator().manual_seed(seed + 3)
    keep = torch.zeros(len(lengths), heads, width, dtype=torch.int64)
    for r, (n, b) in enumerate(zip(lengths, counts)):
        for h in range(heads):
            if h == 0:
                keep[r, h, :b] = torch.arange(n - b, n)  # a pure shift: every kept slot moves
            else:
                keep[r, h, :b] = torch.sort(torch.randperm(n, generator=g)[:b]).values
    return keep


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_compact_matches_reference(device, kernel_backend, layout, dtype, d):
    if d == 128 and (layout != "cpu" or dtype != torch.bfloat16):
        pytest.skip("head_dim 128 runs once (CPU layout, bf16) to keep the interpreter fast")
    heads, nb = 3, 24
    lengths, counts = [70, 37, 16], [29, 37, 5]  # partial pages; one request keeps everything
    table = block_table(lengths, BS, nb, device)
    k, v = make_kv(nb, heads, BS, d, dtype, layout, device)
    state = torch.randn(nb, heads, BS, generator=torch.Generator().manual_seed(9)).to(device)
    pos = torch.randint(0, 1000, (nb, heads, BS), generator=torch.Generator().manual_seed(8)).to(device)
    keep = _keeps(lengths, counts, heads, max(counts), seed=1).to(device)
    cnt = torch.tensor(counts, device=device)
    ref = [t.clone() for t in (k, v, state, pos)]  # K and V never overlap, so separate clones are exact
    paged.compact_tokens_batched(ref, table, keep, cnt)
    before = k.clone()
    ops.compact_tokens([k, v, state, pos], table, keep, counts=cnt, backend=kernel_backend)
    assert not torch.equal(k, before), "the case must move data"
    for got, want in zip((k, v, state, pos), ref):
        assert torch.equal(got, want)


def test_compact_single_request_api(device, kernel_backend):
    """The engine's signature: 1-D block ids, keep [H, b]."""
    nb, heads, d = 8, 2, 64
    k, v = make_kv(nb, heads, BS, d, torch.float32, "cpu", device, seed=4)
    ids = torch.tensor([5, 2, 7, 0], device=device)
    keep = torch.stack([torch.tensor([3, 17, 18, 40, 63]), torch.tensor([0, 1, 2, 33, 50])]).to(device)
    rk, rv = k.clone(), v.clone()
    paged.compact_tokens([rk, rv], ids, keep)
    ops.compact_tokens([k, v], ids, keep, backend=kernel_backend)
    assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_matches_reference(device, layout):
    nb, heads, d = 10, 3, 64
    k, v = make_kv(nb, heads, BS, d, torch.bfloat16, layout, device, seed=5)
    ids = torch.tensor([9, 1, 4, 6], device=device)
    for t in (k, v):
        assert torch.equal(ops.gather_tokens(t, ids, 53, backend="triton"), paged.gather_tokens(t, ids, 53))
    state = torch.randn(nb, heads, BS).to(device)
    assert torch.equal(ops.gather_tokens(state, ids, 53, backend="triton"), paged.gather_tokens(state, ids, 53))
