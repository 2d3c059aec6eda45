"""KeyDiff, CAOTE/FastCAOTE and CriticalKV kernels against the policy library's math."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import ops, paged
from vllm_evict.policies.caote import normalise_mass
from vllm_evict.policies.criticalkv import projected_value_l1
from vllm_evict.policies.keydiff import keydiff_scores

from kernel_cases import TOL, assert_same_keep, block_table, make_kv

BS = 16
LENGTHS = [75, 40, 17]


def _cache(device, dtype, d, heads=3, layout="nhd", seed=0, lengths=LENGTHS):
    nb = sum(-(-n // BS) for n in lengths) + 2
    k, v = make_kv(nb, heads, BS, d, dtype, layout, device, seed=seed)
    return k, v, block_table(lengths, BS, nb, device, seed=seed), torch.tensor(lengths, device=device)


@pytest.mark.parametrize("layout", ["nhd", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_keydiff(device, layout, dtype):
    k, _, table, lens = _cache(device, dtype, 64, layout=layout, seed=2)
    k[0, 0, 0].zero_()  # an all-zero key: k̂ = 0, not NaN
    out = ops.keydiff_scores(k, table, lens, backend="triton")
    ref = paged.paged_keydiff_scores(k, table, lens)
    assert torch.isinf(out[1, :, 40:]).all() and torch.isfinite(out[1, :, :40]).all()
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=1e-5)
    assert_same_keep(out, ref, LENGTHS, budget=10, rtol=TOL[dtype])
    # the reference is the policy's own function on the gathered keys
    keys = paged.gather_tokens(k, table[2].long(), 17)
    torch.testing.assert_close(out[2, :, :17], keydiff_scores(keys), rtol=TOL[dtype], atol=1e-5)


def test_keydiff_head_dim_128(device):
    k, _, table, lens = _cache(device, torch.bfloat16, 128, layout="hnd", seed=4, lengths=[33, 20])
    out = ops.keydiff_scores(k, table, lens, backend="triton")
    torch.testing.assert_close(out, paged.paged_keydiff_scores(k, table, lens), rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_caote(device, fast, dtype):
    _, v, table, lens = _cache(device, dtype, 64, layout="cpu", seed=6)
    g = torch.Generator().manual_seed(3)
    mass = torch.rand(3, 3, 75, generator=g) ** 4
    mass = mass * (torch.arange(75) < torch.tensor(LENGTHS).view(-1, 1, 1))
    alpha = torch.stack([torch.nn.functional.pad(normalise_mass(mass[r, :, :n]), (0, 75 - n))
                         for r, n in enumerate(LENGTHS)])
    alpha[2, 1, :17] = 0.0
    alpha[2, 1, 4] = 1.0  # 1 - alpha < eps: +inf
    alpha = alpha.to(device)
    out = ops.caote_scores(v, table, lens, alpha, fast=fast, backend="triton")
    ref = paged.paged_caote_scores(v, table, lens, alpha, fast=fast)
    assert out[2, 1, 4] == float("inf") and out[2, 1, 5] == 0
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=1e-6)
    assert_same_keep(out, ref, LENGTHS, budget=10, rtol=TOL[dtype])


@pytest.mark.parametrize("group,d,dtype", [(1, 64, torch.float32), (3, 64, torch.bfloat16),
                                           (7, 64, torch.float16), (3, 128, torch.bfloat16)])
def test_criticalkv_value_norms(device, group, d, dtype):
    heads = 2
    lengths = [50, 23]
    _, v, table, lens = _cache(device, dtype, d, heads=heads, layout="nhd", seed=8, lengths=lengths)
    g = torch.Generator().manual_seed(5)
    o_proj = (torch.randn(80, heads * group * d, generator=g) * d ** -0.5).to(dtype).to(device)
    starts = torch.tensor([34, 0], device=device)  # new tokens: a prefill chunk and a whole prompt
    nb = v.shape[0]
    out = torch.full((nb, heads, BS), -1.0, device=device)
    ref = out.clone()
    ops.criticalkv_value_norms(v, table, starts, lens, o_proj, out, backend="triton")
    paged.paged_criticalkv_value_norms(v, table, starts, lens, o_proj, ref)
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=1e-4)
    nu = paged.gather_tokens(out, table[0].long(), 50)
    assert (nu[:, :34] == -1).all(), "slots before the new tokens are left alone"
    values = paged.gather_tokens(v, table[0].long(), 50)[:, 34:]
    torch.testing.assert_close(nu[:, 34:], projected_value_l1(values, o_proj), rtol=TOL[dtype], atol=1e-4)


def test_multi_chunk_reductions(device):
    """Pass 1 of KeyDiff and CAOTE split long requests into chunks whose partial sums are added."""
    from vllm_evict.kernels import caote as caote_kernel
    from vllm_evict.kernels import keydiff as keydiff_kernel

    k, v, table, lens = _cache(device, torch.float32, 64, layout="hnd", seed=12)
    out = keydiff_kernel.keydiff_scores(k, table, lens, block_n=16, chunk=32)
    torch.testing.assert_close(out, paged.paged_keydiff_scores(k, table, lens), rtol=1e-3, atol=1e-6)
    alpha = torch.stack([torch.nn.functional.pad(normalise_mass(torch.rand(3, n)), (0, 75 - n))
                         for n in LENGTHS]).to(device)
    for fast in (False, True):
        out = caote_kernel.caote_scores(v, table, lens, alpha, fast=fast, block_n=16, chunk=32)
        torch.testing.assert_close(out, paged.paged_caote_scores(v, table, lens, alpha, fast=fast),
                                   rtol=1e-3, atol=1e-6)
