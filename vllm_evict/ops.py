"""The eviction operations the engine calls, each dispatched to CUDA, Triton or the PyTorch reference.

One function per operation. The backend is picked per call:

* an explicit ``backend=`` ("cuda" | "triton" | "torch") wins; "triton" on CPU tensors runs the Triton
  interpreter, which needs ``TRITON_INTERPRET=1`` set before Triton is first imported (tests do this);
* CPU tensors otherwise always take the PyTorch reference (vllm_evict/paged.py);
* CUDA tensors take the op's preferred backend when it is available for these arguments, else the
  next one in the order cuda -> triton -> torch.

The preference table starts as: CUDA for ``compact_tokens`` and ``window_mass`` (when the
extension builds), Triton for the rest. ``benchmarks/kernels.py`` measures both and prints the table
to use; set it with ``set_preference(op, backend)`` or the environment variable
``VLLM_EVICT_KERNELS="window_mass=triton,compact_tokens=cuda"``.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Any

import torch
from torch import Tensor

from vllm_evict import dense, paged

BACKENDS = ("cuda", "triton", "torch")
OPS = ("compact_tokens", "window_mass", "keydiff_scores", "output_error", "value_norms")
CUDA_OPS = ("compact_tokens", "window_mass")
DEFAULT_PREFERENCE = {op: ("cuda" if op in CUDA_OPS else "triton") for op in OPS}
_preference: dict[str, str] = dict(DEFAULT_PREFERENCE)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def set_preference(op: str, backend: str) -> None:
    """Preferred backend of ``op`` on CUDA tensors (falls back down cuda -> triton -> torch)."""
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}; operations: {', '.join(OPS)}")
    _check_backend(backend)
    if backend == "cuda" and op not in CUDA_OPS:
        raise ValueError(f"{op} has no CUDA kernel; CUDA kernels exist for {', '.join(CUDA_OPS)}")
    _preference[op] = backend


def preferences() -> dict[str, str]:
    return dict(_preference)


def reset_preferences() -> None:
    _preference.clear()
    _preference.update(DEFAULT_PREFERENCE)


def _load_env_preferences() -> None:
    spec = os.environ.get("VLLM_EVICT_KERNELS", "").strip()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        op, _, backend = item.partition("=")
        set_preference(op.strip(), backend.strip())


_load_env_preferences()


# ---- availability ----------------------------------------------------------------------------------
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_module(name: str) -> Any:
    return importlib.import_module(f"vllm_evict.kernels.{name}")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def cuda_extension() -> Any:
    """The compiled CUDA extension, or None (``vllm_evict.csrc.load_error()`` says why)."""
    from vllm_evict import csrc

    return csrc.load_extension()


def _triton_ok(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or interpreting())


_forced: str | None = None  # see ``use_backend``


class use_backend:
    """``with ops.use_backend("triton"): ...`` runs every operation that is given no explicit backend on
    ``backend`` (tests run the engine's own calls through the Triton interpreter on CPU this way)."""

    def __init__(self, backend: str) -> None:
        _check_backend(backend)
        self.backend = backend

    def __enter__(self) -> None:
        global _forced
        self._previous, _forced = _forced, self.backend

    def __exit__(self, *exc: Any) -> None:
        global _forced
        _forced = self._previous


def select_backend(op: str, device: torch.device, backend: str | None = None, cuda_ok: bool = True) -> str:
    """The backend ``op`` runs on for tensors on ``device``. ``cuda_ok``: these arguments are within
    what the CUDA kernel supports."""
    if backend is None and _forced is not None:
        backend = _forced if (_forced != "cuda" or op in CUDA_OPS and cuda_ok) else "triton"
    if backend is not None:
        _check_backend(backend)
        if backend == "triton" and not _triton_ok(device):
            raise RuntimeError(
                f"{op}: the Triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before Triton is "
                f"imported to run CPU tensors through the interpreter (got device {device})")
        if backend == "cuda":
            if op not in CUDA_OPS:
                raise RuntimeError(f"{op} has no CUDA kernel; CUDA kernels exist for {', '.join(CUDA_OPS)}")
            if device.type != "cuda" or not cuda_ok:
                raise RuntimeError(f"{op}: the CUDA kernel does not take these arguments (device {device})")
            if cuda_extension() is None:
                from vllm_evict import csrc

                raise RuntimeError(f"{op}: the CUDA extension is not available: {csrc.load_error()}")
        return backend
    if device.type != "cuda":
        return "torch"
    order = BACKENDS[BACKENDS.index(_preference[op]):]
    for candidate in order:
        if candidate == "cuda" and op in CUDA_OPS and cuda_ok and cuda_extension() is not None:
            return "cuda"
        if candidate == "triton" and _triton_ok(device):
            return "triton"
        if candidate == "torch":
            return "torch"
    return "torch"


# ---- operations ------------------------------------------------------------------------------------
# Each takes the arguments of its PyTorch reference in vllm_evict/paged.py (or vllm_evict/dense.py for
# value_norms), where the shapes and the padding convention are documented.


def compact_tokens(caches: list[Tensor], block_table: Tensor, keep: Tensor, counts: Tensor, *,
                   backend: str | None = None) -> None:
    """Move kept slots ``keep`` [R, H, b] into each row's first ``counts[r]`` slots, per head, in place,
    in every tensor of ``caches`` (K and V views, positions, state; any strides)."""
    if keep.numel() == 0 or not caches:
        return
    device = caches[0].device
    # An fp8 cache moves as bytes: a raw copy on every backend, whatever float8 support each has.
    caches = [paged.as_bytes(c) for c in caches]
    ok = all(c.dim() in (3, 4) and c.element_size() in (1, 2, 4, 8) for c in caches)
    chosen = select_backend("compact_tokens", device, backend, cuda_ok=ok)
    if chosen == "torch":
        paged.compact_tokens(caches, block_table, keep, counts)
    elif chosen == "triton":
        _triton_module("compact").compact_tokens(caches, block_table, keep, counts)
    else:
        ext = cuda_extension()
        for cache in caches:
            ext.compact_(cache, block_table, keep, counts)


_CUDA_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _window_cuda_ok(k_cache: Tensor, queries: Tensor, positions: Tensor, k_scale: Tensor | None) -> bool:
    """Whether the CUDA window kernels take these keys and queries: keys and queries of one dtype
    (fp32/fp16/bf16), or fp8 keys with their scale and fp16/bf16 queries; head size up to 256."""
    if k_scale is None:
        dtypes_ok = queries.dtype == k_cache.dtype and k_cache.dtype in _CUDA_FLOATS
    else:
        dtypes_ok = (k_cache.dtype in paged.FP8_DTYPES and queries.dtype in (torch.float16, torch.bfloat16)
                     and k_scale.dtype == torch.float32 and k_scale.numel() == 1)
    return dtypes_ok and k_cache.dim() == 4 and k_cache.shape[3] <= 256 and positions.dtype == torch.int32


def window_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
                scale: float, *, positions: Tensor, width: int, gain: Tensor | None = None,
                per_query_head: bool = False, k_scale: Tensor | None = None, backend: str | None = None) -> Tensor:
    """Window attention mass of every row: fp32 [R, H_kv, width] (summed over the GQA group) or
    [R, H_kv, G, width]; queries [R, W, H_q, d] with positions [R, W]; gain None or [R, W].

    ``k_scale``: for an fp8 key cache (float8_e4m3fn / float8_e5m2, vLLM's ``kv_cache_dtype="fp8*"``), the
    layer's fp32 key scale, a [] or [1] tensor on the cache's device (vLLM's ``layer._k_scale``); the
    kernels read the fp8 keys and dequantise them as ``k.float() * k_scale`` on the fly (the queries stay in
    the model dtype). None: the keys are used as stored."""
    ok = not per_query_head and _window_cuda_ok(k_cache, queries, positions, k_scale)
    chosen = select_backend("window_mass", k_cache.device, backend, cuda_ok=ok)
    args = (k_cache, block_table, lengths, queries, query_positions, scale)
    kwargs = dict(positions=positions, width=width, gain=gain, per_query_head=per_query_head, k_scale=k_scale)
    if chosen == "torch":
        return paged.window_mass(*args, **kwargs)
    if chosen == "triton":
        return _triton_module("window_mass").window_mass(*args, **kwargs)
    return cuda_extension().window_mass(k_cache, block_table, lengths, queries, query_positions, float(scale),
                                        positions, int(width), gain, k_scale)


def accumulate_window_mass(state: Tensor, k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                           query_positions: Tensor, scale: float, *, positions: Tensor, width: int,
                           gain: Tensor | None = None, k_scale: Tensor | None = None,
                           backend: str | None = None) -> None:
    """``window_mass`` added into the paged fp32 ``state`` in place: [num_pages, H_kv, bs] (summed over the
    GQA group) or [num_pages, H_kv, bs, G] (per query head), at each row's slots below its length.
    ``k_scale``: as in ``window_mass``."""
    ok = (state.dim() == 3 and state.dtype == torch.float32
          and _window_cuda_ok(k_cache, queries, positions, k_scale))
    chosen = select_backend("window_mass", k_cache.device, backend, cuda_ok=ok)
    args = (state, k_cache, block_table, lengths, queries, query_positions, scale)
    kwargs = dict(positions=positions, width=width, gain=gain, k_scale=k_scale)
    if chosen == "torch":
        paged.accumulate_window_mass(*args, **kwargs)
    elif chosen == "triton":
        _triton_module("window_mass").accumulate_window_mass(*args, **kwargs)
    else:
        cuda_extension().accumulate_window_mass_(state, k_cache, block_table, lengths, queries, query_positions,
                                                 float(scale), positions, int(width), gain, k_scale)


def keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor, *, width: int,
                   k_scale: Tensor | None = None, backend: str | None = None) -> Tensor:
    """KeyDiff −k̂ᵀμ of every row's slots: fp32 [R, H_kv, width], -inf padding. ``k_scale``: as in
    ``window_mass`` (fp8 keys dequantised in the kernel)."""
    chosen = select_backend("keydiff_scores", k_cache.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("keydiff").keydiff_scores(k_cache, block_table, lengths, width=width, k_scale=k_scale)
    return paged.keydiff_scores(k_cache, block_table, lengths, width=width, k_scale=k_scale)


def output_error(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor, *, fast: bool = False,
                 eps: float = 1e-6, v_scale: Tensor | None = None, backend: str | None = None) -> Tensor:
    """CAOTE's output error (``fast``: FastCAOTE) from normalised base weights ``alpha`` [R, H_kv, width]:
    fp32 [R, H_kv, width], -inf padding. ``v_scale``: for an fp8 value cache, the layer's fp32 value scale
    ([] or [1], on the cache's device; values dequantised in the kernel as ``v.float() * v_scale``)."""
    chosen = select_backend("output_error", v_cache.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("output_error").output_error(v_cache, block_table, lengths, alpha, fast=fast, eps=eps,
                                                           v_scale=v_scale)
    return paged.output_error(v_cache, block_table, lengths, alpha, fast=fast, eps=eps, v_scale=v_scale)


def value_norms(values: Tensor, o_proj: Tensor, *, backend: str | None = None) -> Tensor:
    """CriticalKV's ν of tokens entering the cache: values [H_kv, T, d] -> fp32 [H_kv, T]."""
    chosen = select_backend("value_norms", values.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("value_norms").value_norms(values, o_proj)
    return dense.value_norms(values, o_proj)


def describe(device: torch.device | str = "cuda") -> dict[str, str]:
    """The backend each operation uses for tensors on ``device`` now (the start-up log, the benchmark);
    window_mass also names the one for per-query-head masses, which the CUDA kernel does not compute."""
    device = torch.device(device)
    out = {}
    for op in OPS:
        try:
            out[op] = select_backend(op, device)
            if op == "window_mass" and out[op] == "cuda":
                out[op] += f" (per query head: {select_backend(op, device, cuda_ok=False)})"
        except Exception as exc:  # pragma: no cover - diagnostics only
            warnings.warn(f"{op}: {exc}")
            out[op] = "?"
    return out
