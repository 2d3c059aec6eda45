"""The eviction operations the engine calls, each dispatched to CUDA, Triton or the PyTorch reference.

One function per operation. The backend is picked per call:

* an explicit ``backend=`` ("cuda" | "triton" | "torch") wins; "triton" on CPU tensors runs the Triton
  interpreter, which needs ``TRITON_INTERPRET=1`` set before Triton is first imported (tests do this);
* CPU tensors otherwise always take the PyTorch reference (vllm_evict/paged.py);
* CUDA tensors take the op's preferred backend when it is available for these arguments, else the
  next one in the order cuda -> triton -> torch.

The preference table starts as: CUDA for ``compact_tokens`` and ``window_attention_mass`` (when the
extension builds), Triton for the rest. ``benchmarks/kernels.py`` measures both and prints the table
to use; set it with ``set_preference(op, backend)`` or the environment variable
``VLLM_EVICT_KERNELS="window_attention_mass=triton,compact_tokens=cuda"``.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from typing import Any

import torch
from torch import Tensor

from vllm_evict import paged

BACKENDS = ("cuda", "triton", "torch")
OPS = ("gather_tokens", "compact_tokens", "window_attention_mass", "keydiff_scores", "caote_scores",
       "criticalkv_value_norms")
CUDA_OPS = ("compact_tokens", "window_attention_mass")
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


def select_backend(op: str, device: torch.device, backend: str | None = None, cuda_ok: bool = True) -> str:
    """The backend ``op`` runs on for tensors on ``device``. ``cuda_ok``: these arguments are within
    what the CUDA kernel supports."""
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
def gather_tokens(cache: Tensor, block_ids: Tensor, length: int, *, backend: str | None = None) -> Tensor:
    """[num_blocks, H, bs, *rest] -> [H, length, *rest] for one request (``paged.gather_tokens``)."""
    chosen = select_backend("gather_tokens", cache.device, backend, cuda_ok=False)
    if chosen == "triton" and cache.dim() <= 4:
        return _triton_module("compact").gather(cache, block_ids, length)
    return paged.gather_tokens(cache, block_ids, length)


def write_tokens(cache: Tensor, block_ids: Tensor, start: int, values: Tensor) -> None:
    """Write per-token values [H, m, *rest] into slots start..start+m-1 of one request (in place).

    Used by the engine for the state of new tokens; an indexed store with no kernel of its own."""
    paged.write_tokens(cache, block_ids, start, values)


def compact_tokens(caches: list[Tensor], block_ids: Tensor, keep: Tensor, *, counts: Tensor | None = None,
                   backend: str | None = None) -> None:
    """Move each head's kept slots into its first slots, in place, in every tensor of ``caches``
    (K view, V view, per-token state buffers; any strides).

    One request: ``block_ids`` 1-D and ``keep`` [H, b] (``paged.compact_tokens``). Several requests:
    ``block_ids`` is the block table [R, P], ``keep`` [R, H, b_max] and ``counts`` [R] how many
    columns of each row are used (default all). Keep indices are ascending per head.
    """
    if keep.numel() == 0 or not caches:
        return
    device = caches[0].device
    ok = all(c.dim() in (3, 4) and c.element_size() in (1, 2, 4, 8) for c in caches)
    chosen = select_backend("compact_tokens", device, backend, cuda_ok=ok)
    if chosen == "torch":
        if keep.dim() == 2:
            paged.compact_tokens(caches, block_ids, keep)
        else:
            paged.compact_tokens_batched(caches, block_ids, keep, counts)
        return
    keep3 = keep.unsqueeze(0) if keep.dim() == 2 else keep
    if chosen == "triton":
        _triton_module("compact").compact(caches, block_ids, keep3, counts)
        return
    ext = cuda_extension()
    bt = block_ids.unsqueeze(0) if block_ids.dim() == 1 else block_ids
    if counts is None:
        counts = torch.full((keep3.shape[0],), keep3.shape[2], dtype=torch.int64, device=device)
    for cache in caches:
        ext.compact_(cache, bt, keep3, counts)


def window_attention_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                          query_start_loc: Tensor, query_positions: Tensor, scale: float, *,
                          positions: Tensor | None = None, gain: Tensor | None = None,
                          reduce_group: bool = True, max_len: int | None = None,
                          backend: str | None = None) -> Tensor:
    """Observation-window attention mass of every request: fp32 [R, H_kv, max_len] (summed over the
    GQA group) or [R, H_kv, G, max_len]; see ``paged.paged_window_attention_mass``. Pooling, group
    mean and protection stay with the policy."""
    ok = (reduce_group and queries.dtype == k_cache.dtype
          and k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16)
          and k_cache.dim() == 4 and k_cache.shape[3] <= 256
          and (positions is None or positions.dtype == torch.int64))
    chosen = select_backend("window_attention_mass", k_cache.device, backend, cuda_ok=ok)
    args = (k_cache, block_table, lengths, queries, query_start_loc, query_positions, scale)
    if chosen == "torch":
        return paged.paged_window_attention_mass(*args, positions=positions, gain=gain,
                                                 reduce_group=reduce_group, max_len=max_len)
    if chosen == "triton":
        return _triton_module("window_mass").window_attention_mass(
            *args, positions=positions, gain=gain, reduce_group=reduce_group, max_len=max_len)
    width = int(lengths.max().item()) if max_len is None else int(max_len)
    return cuda_extension().window_mass(k_cache, block_table, lengths, queries, query_start_loc, query_positions,
                                        float(scale), positions, gain, width)


def keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor, *, max_len: int | None = None,
                   backend: str | None = None) -> Tensor:
    """KeyDiff −k̂ᵀμ of every request's slots: fp32 [R, H_kv, max_len], -inf padding."""
    chosen = select_backend("keydiff_scores", k_cache.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("keydiff").keydiff_scores(k_cache, block_table, lengths, max_len=max_len)
    return paged.paged_keydiff_scores(k_cache, block_table, lengths, max_len=max_len)


def caote_scores(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor, *, fast: bool = False,
                 eps: float = 1e-6, backend: str | None = None) -> Tensor:
    """CAOTE (``fast``: FastCAOTE) value term from normalised base scores ``alpha`` [R, H_kv, width]:
    fp32 [R, H_kv, width], -inf padding."""
    chosen = select_backend("caote_scores", v_cache.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("caote").caote_scores(v_cache, block_table, lengths, alpha, fast=fast, eps=eps)
    return paged.paged_caote_scores(v_cache, block_table, lengths, alpha, fast=fast, eps=eps)


def criticalkv_value_norms(v_cache: Tensor, block_table: Tensor, starts: Tensor, ends: Tensor, o_proj: Tensor,
                           out: Tensor, *, backend: str | None = None) -> Tensor:
    """CriticalKV's ν for the new slots ``starts[r]:ends[r]`` of every request, written into the paged
    fp32 state buffer ``out`` [num_blocks, H_kv, block_size]; returns ``out``."""
    chosen = select_backend("criticalkv_value_norms", v_cache.device, backend, cuda_ok=False)
    if chosen == "triton":
        return _triton_module("criticalkv").criticalkv_value_norms(v_cache, block_table, starts, ends, o_proj, out)
    return paged.paged_criticalkv_value_norms(v_cache, block_table, starts, ends, o_proj, out)


def describe() -> dict[str, str]:
    """Which backend each op would use on a CUDA device now (for logs and the benchmark)."""
    device = torch.device("cuda")
    out = {}
    for op in OPS:
        try:
            out[op] = select_backend(op, device)
        except Exception as exc:  # pragma: no cover - diagnostics only
            warnings.warn(f"{op}: {exc}")
            out[op] = "?"
    return out
