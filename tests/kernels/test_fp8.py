"""Scores read from an fp8 KV cache (issue #29): every scoring op takes the layer's scale (``k_scale`` /
``v_scale``) and dequantises the fp8 keys or values inside its kernels.

Each op is checked three ways: the kernels (Triton, in the interpreter on CPU; CUDA where it exists)
against the PyTorch reference with the scale; that reference against the same op on an explicitly
dequantised fp32 copy of the cache (so the reference itself is right); and a scale of None leaving the
launches and the results as they were. compact_tokens moves fp8 caches byte for byte."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from vllm_evict import dense, ops, paged

from kernel_cases import (FORBIDDEN_OPS, LAYOUTS, NULL_PAGE, TOL, OpLog, assert_same_keep, block_table, make_kv,
                          pages_needed, positions_buffer)

PAGE = 16
LENGTHS = (75, 40, 17, 0)
ENTRIES = (8, 5, 1, 3)
WIDTH = 96
SCALE = 0.37  # vLLM stores fp8(x / scale): a non-trivial scale so that forgetting it shows
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# fp8 keys dequantised into bf16 queries' dtype for tensor cores on a GPU: the bf16 tolerance applies.
FP8_TOL = TOL[torch.bfloat16]


def quantise(k: Tensor, v: Tensor, dtype: torch.dtype, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(k8, v8, k32, v32): the K/V views of ``make_kv`` re-made over one fp8 buffer holding ``raw / scale``
    (same strides, same layout), and the same views over its exact fp32 dequantisation."""
    raw = k._base if k._base is not None else k
    assert v._base is raw or v._base is None and v is raw
    q8 = (raw.float() / scale).to(dtype)
    deq = q8.float() * scale

    def like(base: Tensor, view: Tensor) -> Tensor:
        return torch.as_strided(base, view.shape, view.stride(), view.storage_offset())

    return like(q8, k), like(q8, v), like(deq, k), like(deq, v)


def scale_tensor(device: torch.device, shape: tuple[int, ...] = ()) -> Tensor:
    return torch.full(shape, SCALE, dtype=torch.float32, device=device)


def window_case(device: torch.device, fp8: torch.dtype, *, group: int = 3, d: int = 64, layout: str = "nhd",
                seed: int = 0, gain: bool = False, scale_shape: tuple[int, ...] = ()) -> tuple[dict, Tensor]:
    """(kwargs of window_mass with fp8 keys, bf16 queries and ``k_scale``, the fp32 dequantised key view)."""
    heads = 2
    n_pages = pages_needed(list(LENGTHS), PAGE) + 2
    k, v = make_kv(n_pages, heads, PAGE, d, torch.bfloat16, layout, device, seed=seed)
    k8, _, k32, _ = quantise(k, v, fp8, SCALE)
    table = block_table(list(LENGTHS), PAGE, n_pages, device, seed=seed)
    pos = positions_buffer(n_pages, heads, PAGE, table, list(LENGTHS), device, seed)
    g = torch.Generator().manual_seed(seed + 7)
    window = 8
    qpos = torch.full((len(LENGTHS), window), dense.EMPTY_QUERY, dtype=torch.int64)
    for r, (n, e) in enumerate(zip(LENGTHS, ENTRIES)):
        qpos[r, :e] = torch.arange(2 * n - e, 2 * n) if n else torch.arange(e)
        qpos[r] = qpos[r].roll(r)
    # Keys are ~1 / 0.37 before the scale: modest queries keep the softmax from saturating.
    queries = (torch.randn(len(LENGTHS), window, heads * group, d, generator=g) * 0.5).to(torch.bfloat16)
    gains = (torch.rand(len(LENGTHS), window, generator=g) * 2 + 0.3).to(device) if gain else None
    case = dict(k_cache=k8, block_table=table, lengths=torch.tensor(LENGTHS, device=device),
                queries=queries.to(device), query_positions=qpos.to(device), scale=d ** -0.5, positions=pos,
                width=WIDTH, gain=gains, k_scale=scale_tensor(device, scale_shape))
    return case, k32


def _check_mass(out: Tensor, ref: Tensor, lengths: Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=FP8_TOL, atol=FP8_TOL * 1e-2)
    pad = ~dense.valid_slots(lengths, out.shape[-1])
    if out.dim() == 4:
        pad = pad.unsqueeze(1)
    assert (out.masked_select(pad) == 0).all()
    assert_same_keep(out, ref, lengths, budget=12, rtol=FP8_TOL)


# ---- window mass ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("per_query_head,gain,layout,scale_shape", [
    (False, False, "nhd", ()), (False, True, "cpu", (1,)), (True, True, "hnd", ()), (True, False, "nhd", (1,))])
def test_window_mass_fp8(device, backend, fp8, per_query_head, gain, layout, scale_shape):
    if backend == "cuda" and per_query_head:
        pytest.skip("the CUDA kernel sums over the group (ops falls back to Triton per query head)")
    case, k32 = window_case(device, fp8, layout=layout, seed=3, gain=gain, scale_shape=scale_shape)
    out = ops.window_mass(**case, per_query_head=per_query_head, backend=backend)
    ref = paged.window_mass(**case, per_query_head=per_query_head)
    assert ref[:3].abs().sum() > 0
    _check_mass(out, ref, case["lengths"])
    # The reference with the scale is the reference over the dequantised cache, exactly.
    dequantised = paged.window_mass(**{**case, "k_cache": k32, "k_scale": None}, per_query_head=per_query_head)
    assert torch.equal(ref, dequantised)
    # ... and the scale is not a no-op.
    unscaled = paged.window_mass(**{**case, "k_scale": None}, per_query_head=per_query_head)
    assert not torch.allclose(ref, unscaled, atol=1e-3)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("per_query_head,gain", [(False, False), (False, True), (True, True)])
def test_accumulate_window_mass_fp8(device, backend, fp8, per_query_head, gain):
    if backend == "cuda" and per_query_head:
        pytest.skip("the CUDA kernel sums over the group (ops falls back to Triton per query head)")
    group = 3
    case, k32 = window_case(device, fp8, group=group, layout="hnd", seed=5, gain=gain)
    k = case["k_cache"]
    shape = (*k.shape[:3], group) if per_query_head else k.shape[:3]
    before = (torch.rand(shape, generator=torch.Generator().manual_seed(5)) * 3).to(device)
    state, want, dequantised = before.clone(), before.clone(), before.clone()
    ops.accumulate_window_mass(state, **case, backend=backend)
    paged.accumulate_window_mass(want, **case)
    torch.testing.assert_close(state, want, rtol=FP8_TOL, atol=FP8_TOL * 1e-2)
    assert not torch.equal(state, before)
    paged.accumulate_window_mass(dequantised, **{**case, "k_cache": k32, "k_scale": None})
    assert torch.equal(want, dequantised)


def test_window_mass_scale_none_is_unchanged(device, backend):
    """Without a scale: the results are those of a call that never names it, the Triton kernels are
    launched as before (SCALED off, as many launches), and a scale of exactly 1 on a bf16 cache agrees."""
    from vllm_evict.kernels.variants import LaunchRecorder

    case, _ = window_case(device, torch.float8_e4m3fn, seed=9, gain=True)
    k16, _ = make_kv(case["k_cache"].shape[0], 2, PAGE, 64, torch.bfloat16, "nhd", device, seed=9)
    plain = {**case, "k_cache": k16}
    del plain["k_scale"]
    default = ops.window_mass(**plain, backend=backend)
    assert torch.equal(ops.window_mass(**plain, k_scale=None, backend=backend), default)
    state = torch.zeros(k16.shape[:3], device=device)
    ops.accumulate_window_mass(state, **plain, k_scale=None, backend=backend)
    if backend == "triton":
        with LaunchRecorder() as rec:
            ops.window_mass(**plain, k_scale=None, backend="triton")
        assert len(rec.launches) == 2
        assert all(launch.bound().get("SCALED") in (None, False) for launch in rec.launches)
        with LaunchRecorder() as rec:
            ops.window_mass(**case, backend="triton")
        assert len(rec.launches) == 2 and all(launch.bound()["SCALED"] for launch in rec.launches)
        one = ops.window_mass(**plain, k_scale=scale_tensor(device) * 0 + 1, backend="triton")
        torch.testing.assert_close(one, default, rtol=FP8_TOL, atol=FP8_TOL * 1e-2)


def test_window_mass_fp8_launcher_dispatches_no_sync(device):
    """With a scale the launcher still reads nothing back and converts no argument."""
    case, _ = window_case(device, torch.float8_e4m3fn, seed=8, gain=True)
    ops.window_mass(**case, backend="triton")
    with OpLog() as log:
        ops.window_mass(**case, backend="triton")
        ops.keydiff_scores(case["k_cache"], case["block_table"], case["lengths"], width=WIDTH,
                           k_scale=case["k_scale"], backend="triton")
    assert not set(log.ops) & set(FORBIDDEN_OPS), log.ops


def test_window_mass_rejects_a_bad_scale(device):
    case, _ = window_case(device, torch.float8_e4m3fn, seed=1)
    for bad in (torch.full((2,), SCALE, device=device), scale_tensor(device).half()):
        with pytest.raises(ValueError, match="k_scale must be a one-element fp32 tensor"):
            ops.window_mass(**{**case, "k_scale": bad}, backend="triton")


def test_fp8_keys_with_a_scale_may_take_the_cuda_kernel():
    """The dispatch: fp8 keys (either format) with a scale and fp16/bf16 queries are within the CUDA
    kernel; fp8 keys without a scale, fp32 queries against fp8 keys, or mixed full-precision dtypes are not."""
    k8 = torch.zeros(3, 2, PAGE, 64, dtype=torch.float8_e4m3fn)
    pos = torch.zeros(3, 2, PAGE, dtype=torch.int32)
    q = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    s = torch.tensor([SCALE])
    assert ops._window_cuda_ok(k8, q, pos, s)
    assert ops._window_cuda_ok(k8.view(torch.float8_e5m2), q.half(), pos, s.view(()))
    assert not ops._window_cuda_ok(k8, q, pos, None)
    assert not ops._window_cuda_ok(k8, q.float(), pos, s)
    assert not ops._window_cuda_ok(k8, q, pos, s.double())
    assert not ops._window_cuda_ok(k8.bfloat16(), q.half(), pos, None)
    assert ops._window_cuda_ok(k8.bfloat16(), q, pos, None)


def test_window_mass_fp8_prefers_cuda_on_a_gpu(device):
    if device.type != "cuda" or ops.cuda_extension() is None:
        pytest.skip("needs a CUDA device and the CUDA extension")
    case, _ = window_case(device, torch.float8_e4m3fn, seed=2)
    assert ops.select_backend("window_mass", device, cuda_ok=ops._window_cuda_ok(
        case["k_cache"], case["queries"], case["positions"], case["k_scale"])) == "cuda"
    torch.testing.assert_close(ops.window_mass(**case), paged.window_mass(**case), rtol=FP8_TOL,
                               atol=FP8_TOL * 1e-2)


# ---- KeyDiff and CAOTE ------------------------------------------------------------------------------
def _kv_case(device, fp8, layout, seed):
    heads, d = 3, 64
    n_pages = pages_needed(list(LENGTHS), PAGE) + 1
    k, v = make_kv(n_pages, heads, PAGE, d, torch.bfloat16, layout, device, seed=seed)
    k8, v8, k32, v32 = quantise(k, v, fp8, SCALE)
    table = block_table(list(LENGTHS), PAGE, n_pages, device, seed=seed)
    return k8, v8, k32, v32, table, torch.tensor(LENGTHS, device=device)


def _check_scores(out: Tensor, ref: Tensor, lengths: Tensor, atol: float) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    pad = ~dense.valid_slots(lengths, out.shape[-1]).expand_as(out)
    assert (out[pad] == float("-inf")).all()
    torch.testing.assert_close(out, ref, rtol=FP8_TOL, atol=atol)
    assert_same_keep(out, ref, lengths, budget=10, rtol=FP8_TOL)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layout", ["nhd", "cpu"])
def test_keydiff_fp8(device, triton_backend, fp8, layout):
    k8, _, k32, _, table, lens = _kv_case(device, fp8, layout, seed=2)
    s = scale_tensor(device, (1,) if layout == "cpu" else ())
    out = ops.keydiff_scores(k8, table, lens, width=WIDTH, k_scale=s, backend=triton_backend)
    ref = paged.keydiff_scores(k8, table, lens, width=WIDTH, k_scale=s)
    _check_scores(out, ref, lens, atol=1e-5)
    assert torch.equal(ref, paged.keydiff_scores(k32, table, lens, width=WIDTH))
    # Scale None: unchanged, the keys taken as stored.
    assert torch.equal(ops.keydiff_scores(k32, table, lens, width=WIDTH, k_scale=None, backend=triton_backend),
                       ops.keydiff_scores(k32, table, lens, width=WIDTH, backend=triton_backend))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("fast", [False, True])
def test_output_error_fp8(device, triton_backend, fp8, fast):
    _, v8, _, v32, table, lens = _kv_case(device, fp8, "hnd", seed=6)
    g = torch.Generator().manual_seed(3)
    valid = dense.valid_slots(torch.tensor(LENGTHS), WIDTH)
    alpha = dense.normalise_mass(torch.rand(len(LENGTHS), 3, WIDTH, generator=g) ** 4, valid).to(device)
    s = scale_tensor(device)
    out = ops.output_error(v8, table, lens, alpha, fast=fast, v_scale=s, backend=triton_backend)
    ref = paged.output_error(v8, table, lens, alpha, fast=fast, v_scale=s)
    _check_scores(out, ref, lens, atol=1e-6)
    assert torch.equal(ref, paged.output_error(v32, table, lens, alpha, fast=fast))
    unscaled = paged.output_error(v8, table, lens, alpha, fast=fast)
    assert not torch.allclose(ref[:3], unscaled[:3]), "the scale must change the errors"
    assert torch.equal(ops.output_error(v32, table, lens, alpha, fast=fast, v_scale=None, backend=triton_backend),
                       ops.output_error(v32, table, lens, alpha, fast=fast, backend=triton_backend))


def test_dequantize():
    x = torch.tensor([1.0, -2.5, 448.0]).to(torch.float8_e4m3fn)
    assert paged.dequantize(x, None) is x
    for shape in ((), (1,)):
        got = paged.dequantize(x, torch.full(shape, 0.5))
        assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([0.5, -1.25, 224.0]))


# ---- compaction -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compact_fp8_moves_bytes(device, backend, fp8, layout):
    lengths, counts = [70, 37, 16, 0, 21], [29, 37, 5, 0, 0]
    heads, d, width = 3, 32, 80
    n_pages = pages_needed(lengths, PAGE)
    table = block_table(lengths, PAGE, n_pages, device)
    k, v = make_kv(n_pages, heads, PAGE, d, torch.bfloat16, layout, device)
    k8, v8, _, _ = quantise(k, v, fp8, SCALE)
    positions = torch.randint(0, 1 << 20, k.shape[:3], generator=torch.Generator().manual_seed(9),
                              dtype=torch.int32).to(device)
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(len(lengths), heads, width, generator=g)
    scores[0, 0] = torch.arange(width, dtype=torch.float32)
    keep = dense.topk_keep(scores, dense.valid_slots(torch.tensor(lengths), width), torch.tensor(counts),
                           max(counts)).to(device)
    counts_t = torch.tensor(counts, device=device)
    # The reference moves the raw bytes: uint8 twins of the fp8 views, over one cloned buffer.
    twin = k8._base.clone()
    ref = [torch.as_strided(twin, t.shape, t.stride(), t.storage_offset()).view(torch.uint8) for t in (k8, v8)]
    ref.append(positions.clone())
    paged.compact_tokens(ref, table, keep, counts_t)
    before = k8.view(torch.uint8).clone()
    ops.compact_tokens([k8, v8, positions], table, keep, counts_t, backend=backend)
    assert k8.dtype == fp8
    assert not torch.equal(k8.view(torch.uint8), before), "the case must move data"
    for got, want in zip((k8.view(torch.uint8), v8.view(torch.uint8), positions), ref):
        assert torch.equal(got[NULL_PAGE + 1:], want[NULL_PAGE + 1:])
