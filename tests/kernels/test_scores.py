"""keydiff_scores, output_error and value_norms on the torch and Triton backends against their
references (paged.keydiff_scores / paged.output_error over dense.*, dense.value_norms)."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import dense, ops, paged

from kernel_cases import FORBIDDEN_OPS, TOL, OpLog, assert_same_keep, block_table, make_kv, pages_needed

PAGE = 16
LENGTHS = [75, 40, 17, 0]
WIDTH = 90  # > every length: padding on every row


def _cache(device, dtype, d, *, heads=3, layout="nhd", seed=0, lengths=LENGTHS, table_dtype=torch.int32):
    n_pages = pages_needed(lengths, PAGE) + 1
    k, v = make_kv(n_pages, heads, PAGE, d, dtype, layout, device, seed=seed)
    table = block_table(lengths, PAGE, n_pages, device, seed=seed, dtype=table_dtype)
    return k, v, table, torch.tensor(lengths, device=device)


def _alpha(lengths, heads, width, seed, device):
    """Normalised base weights as CAOTE computes them: [R, H, width], 0 on padding."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    mass = torch.rand(len(lengths), heads, width, generator=g) ** 4
    return dense.normalise_mass(mass, dense.valid_slots(lens, width)).to(device)


def _check_scores(out, ref, lengths, dtype, atol):
    assert out.shape == ref.shape and out.dtype == torch.float32
    pad = ~dense.valid_slots(lengths, out.shape[-1]).expand_as(out)
    assert (out[pad] == float("-inf")).all(), "padding slots must hold -inf"
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=atol)
    assert_same_keep(out, ref, lengths, budget=10, rtol=TOL[dtype])


# ---- KeyDiff ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,dtype", [("nhd", torch.float32), ("cpu", torch.bfloat16), ("hnd", torch.float16)])
def test_keydiff(device, triton_backend, layout, dtype):
    k, _, table, lens = _cache(device, dtype, 64, layout=layout, seed=2)
    k[table[0, 0].long(), 1, 3].zero_()  # an all-zero key of row 0: k̂ = 0, a score of exactly 0
    out = ops.keydiff_scores(k, table, lens, width=WIDTH, backend=triton_backend)
    ref = paged.keydiff_scores(k, table, lens, width=WIDTH)
    assert out[0, 1, 3] == 0
    _check_scores(out, ref, lens, dtype, atol=1e-5)


def test_keydiff_multi_chunk_int64_table(device):
    """Pass 1 splits rows into chunks whose partials pass 2 adds; int64 block table; head size 128."""
    from vllm_evict.kernels import keydiff

    k, _, table, lens = _cache(device, torch.float32, 128, layout="hnd", seed=12, table_dtype=torch.int64)
    out = keydiff.keydiff_scores(k, table, lens, width=WIDTH, block_n=16, chunk=32)
    _check_scores(out, paged.keydiff_scores(k, table, lens, width=WIDTH), lens, torch.float32, atol=1e-6)


# ---- CAOTE output error -----------------------------------------------------------------------------
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("layout,dtype", [("cpu", torch.float32), ("nhd", torch.bfloat16), ("hnd", torch.float16)])
def test_output_error(device, triton_backend, fast, layout, dtype):
    _, v, table, lens = _cache(device, dtype, 64, layout=layout, seed=6)
    alpha = _alpha(LENGTHS, 3, WIDTH, seed=3, device=device)
    alpha[2, 1, :17] = 0.0
    alpha[2, 1, 4] = 1.0  # 1 - alpha < eps: +inf; the rest of the row: 0
    out = ops.output_error(v, table, lens, alpha, fast=fast, backend=triton_backend)
    ref = paged.output_error(v, table, lens, alpha, fast=fast)
    assert out[2, 1, 4] == float("inf") and out[2, 1, 5] == 0
    _check_scores(out, ref, lens, dtype, atol=1e-6)


@pytest.mark.parametrize("fast", [False, True])
def test_output_error_multi_chunk_strided_alpha(device, fast):
    """Multi-chunk centre; alpha read through a non-contiguous bf16 view."""
    from vllm_evict.kernels import output_error

    _, v, table, lens = _cache(device, torch.float32, 64, layout="hnd", seed=12)
    alpha = _alpha(LENGTHS, 3, WIDTH, seed=5, device=device)
    strided = alpha.to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = output_error.output_error(v, table, lens, strided, fast=fast, block_n=16, chunk=32)
    ref = paged.output_error(v, table, lens, strided.float(), fast=fast)
    _check_scores(out, ref, lens, torch.float32, atol=1e-6)


# ---- CriticalKV value norms -------------------------------------------------------------------------
@pytest.mark.parametrize("group,d,dtype", [(1, 64, torch.float32), (3, 32, torch.bfloat16),
                                           (7, 16, torch.float16), (2, 128, torch.bfloat16)])
def test_value_norms(device, triton_backend, group, d, dtype):
    """values [H_kv, T, d] as the step hands them over (a transposed [T, H_kv, d] view), o_proj in the
    model's dtype."""
    heads, tokens, hidden = 2, 37, 80
    g = torch.Generator().manual_seed(group)
    values = torch.randn(tokens, heads, d, generator=g).to(dtype).to(device).transpose(0, 1)
    o_proj = (torch.randn(hidden, heads * group * d, generator=g) * d ** -0.5).to(dtype).to(device)
    out = ops.value_norms(values, o_proj, backend=triton_backend)
    ref = dense.value_norms(values, o_proj)
    assert out.shape == (heads, tokens) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=1e-4)


def test_value_norms_mixed_dtypes_and_no_tokens(device):
    """bf16 values with an fp32 weight (upcast in the kernel); a step with no new token."""
    from vllm_evict.kernels import value_norms

    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 9, 32, generator=g).to(torch.bfloat16).to(device)
    o_proj = torch.randn(48, 4 * 32, generator=g).to(device)
    torch.testing.assert_close(value_norms.value_norms(values, o_proj), dense.value_norms(values, o_proj),
                               rtol=1e-4, atol=1e-4)
    assert value_norms.value_norms(values[:, :0], o_proj).shape == (2, 0)


def test_value_norms_rejects_a_wrong_projection(device):
    values = torch.zeros(2, 3, 16, device=device)
    with pytest.raises(ValueError, match=r"o_proj must be \[hidden, H_q\*16\] with H_q a multiple of 2 KV heads, "
                                         r"got shape \(8, 48\)"):
        ops.value_norms(values, torch.zeros(8, 48, device=device), backend="triton")


# ---- no host-device synchronisation -----------------------------------------------------------------
def test_score_launchers_dispatch_no_sync(device):
    """Each launcher allocates its result and scratch and launches kernels: no .item(), no tensor from
    Python data, no conversion or copy of an argument."""
    k, v, table, lens = _cache(device, torch.float32, 16, heads=1, seed=3, lengths=[20, 7])
    alpha = _alpha([20, 7], 1, 24, seed=1, device=device)
    values = torch.randn(1, 5, 16, device=device)
    o_proj = torch.randn(8, 2 * 16, device=device)
    calls = {
        "keydiff_scores": (lambda: ops.keydiff_scores(k, table, lens, width=24, backend="triton"), 2),
        "output_error": (lambda: ops.output_error(v, table, lens, alpha, fast=False, backend="triton"), 2),
        "value_norms": (lambda: ops.value_norms(values, o_proj, backend="triton"), 1),
    }
    for name, (call, allocations) in calls.items():
        call()  # compile / warm up
        with OpLog() as log:
            call()
        assert not set(log.ops) & set(FORBIDDEN_OPS), (name, log.ops)
        if device.type == "cuda":
            assert log.ops == {"aten.empty": allocations}, (name, log.ops)


def test_kernel_sources_never_read_device_values_on_the_host():
    """Static complement of the dispatch checks (tolist() is invisible to a dispatch mode on CPU)."""
    from pathlib import Path

    import vllm_evict.kernels as package

    for path in Path(package.__file__).parent.glob("*.py"):
        text = path.read_text()
        for needle in (".item(", ".tolist(", ".cpu(", ".numpy(", "torch.tensor("):
            assert needle not in text, f"{path.name} calls {needle}"
