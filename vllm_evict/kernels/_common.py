"""Pieces shared by the Triton kernels: paged slot addressing and launch helpers.

Launchers pass every tensor with its own strides and never convert index tensors: block tables,
lengths, counts, positions and keep lists may be int32 or int64, and the kernels widen what they load.
So a launcher costs its kernels and its output allocations, with no copy and no host-device sync.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

_ALIGNMENT_OPTION = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


def per_step_jit(ints: Sequence[str] = (), pointers: Sequence[str] = ()) -> Callable[[Any], Any]:
    """``triton.jit`` for a kernel launched with per-step numbers: ``ints`` (widths, row strides of
    per-step tensors, counts) are not specialised (Triton would compile a variant per value class: equal
    to 1, divisible by 16, other), nor is the alignment of ``pointers`` (per-step index tensors), so the
    variants compiled at start-up (vllm_evict/engine/warmup.py) are all a server ever launches."""
    options: dict[str, Any] = {"do_not_specialize": list(ints)}
    if pointers and _ALIGNMENT_OPTION:
        options["do_not_specialize_on_alignment"] = list(pointers)
    return triton.jit(**options)


def unspecialised(kernel: Any) -> tuple[set[str], set[str]]:
    """(ints, pointers) a kernel made with ``per_step_jit`` leaves unspecialised (JIT or interpreter)."""
    options = getattr(kernel, "kwargs", None)
    if isinstance(options, dict):  # the interpreter keeps the decorator's arguments
        return set(options.get("do_not_specialize") or ()), set(options.get("do_not_specialize_on_alignment") or ())
    names = [p.name for p in kernel.params]

    def resolve(items: Any) -> set[str]:
        return {names[i] if isinstance(i, int) else i for i in items or ()}

    return resolve(kernel.do_not_specialize), resolve(getattr(kernel, "do_not_specialize_on_alignment", ()))


@triton.jit
def slot_offsets(bt_row_ptr, bt_s_p, slots, block_size, s_blk, s_tok, mask):
    """Element offset (int64) of logical slots ``slots`` of one row in a paged view.

    ``bt_row_ptr`` points at the row of the block table, whose page entries are ``bt_s_p`` apart;
    slot s lives in page ``row[s // block_size]`` at token offset ``s % block_size``.
    """
    page = tl.load(bt_row_ptr + (slots // block_size).to(tl.int64) * bt_s_p, mask=mask, other=0).to(tl.int64)
    return page * s_blk + (slots % block_size).to(tl.int64) * s_tok


@triton.jit
def load_scale(scale_ptr, SCALED: tl.constexpr):
    """The fp32 dequantisation scale of an fp8 cache (a one-element tensor), loaded once per program;
    1.0 and no load without one."""
    scale = 1.0
    if SCALED:
        scale = tl.load(scale_ptr).to(tl.float32)
    return scale


@triton.jit
def dequantize(x, scale, SCALED: tl.constexpr):
    """fp8 elements ``x`` as fp32 ``x * scale`` when SCALED, else ``x`` untouched (same dtype)."""
    if SCALED:
        x = x.to(tl.float32) * scale
    return x


def scale_argument(scale: Tensor | None, cache: Tensor, name: str, stand_in: Tensor) -> tuple[Tensor, bool]:
    """(pointer, SCALED) for a kernel's scale parameter. Without a scale the pointer is ``stand_in``, an fp32
    tensor of the launch that the kernel never reads, so the argument types, and with them the compiled
    variant, are the same on every call. Checks shape, dtype and device only (no read: no sync)."""
    if scale is None:
        return stand_in, False
    if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != cache.device:
        raise ValueError(f"{name} must be a one-element fp32 tensor on {cache.device} ([] or [1]), got "
                         f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")
    return scale, True


def view_strides(cache: Tensor) -> tuple[int, int, int, int, int]:
    """(s_blk, s_head, s_tok, s_dim, d) of a [num_pages, H, bs, d] view, or of a [num_pages, H, bs]
    per-token buffer treated as d = 1."""
    if cache.dim() == 3:
        return cache.stride(0), cache.stride(1), cache.stride(2), 0, 1
    if cache.dim() != 4:
        raise ValueError(f"expected a [num_pages, H, page_size, d] view or a [num_pages, H, page_size] "
                         f"per-token buffer, got shape {tuple(cache.shape)}")
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.shape[3]


def table_strides(block_table: Tensor, rows: int) -> tuple[int, int]:
    """(row stride, page stride) of a [R, pages] block table with R = ``rows``."""
    if block_table.dim() != 2 or block_table.shape[0] != rows:
        raise ValueError(f"block_table must be [R, pages] with R = {rows} rows, got shape {tuple(block_table.shape)}")
    return block_table.stride(0), block_table.stride(1)


def check_index(name: str, t: Tensor) -> None:
    """Index tensors are loaded as they are: int32 or int64 only (a float would be read as garbage)."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def block_d(d: int) -> int:
    """Head-size tile: the next power of two, at least 16 (``tl.dot``'s smallest inner size)."""
    return max(16, triton.next_power_of_2(d))


def dot_precision(*tensors: Tensor) -> str:
    """fp32 operands must not be rounded to tf32 (scores are compared to an fp32 reference)."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


_launch_as_on_cuda = False  # see ``launch_as_on_cuda``


class launch_as_on_cuda:
    """Within this block launchers pick the constexprs a CUDA device would get, also for CPU tensors in
    the Triton interpreter: what ``benchmarks/triton_aot.py`` records to compile every variant ahead of
    time. The interpreter's results are then meaningless (it multiplies bf16 operands as raw integers)."""

    def __enter__(self) -> None:
        global _launch_as_on_cuda
        self._previous, _launch_as_on_cuda = _launch_as_on_cuda, True

    def __exit__(self, *exc: Any) -> None:
        global _launch_as_on_cuda
        _launch_as_on_cuda = self._previous


def needs_upcast(*tensors: Tensor) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 in the kernel: mixed dtypes, or CPU tensors
    (the Triton interpreter multiplies bf16 operands as raw integers)."""
    on_cpu = any(t.device.type != "cuda" for t in tensors) and not _launch_as_on_cuda
    return len({t.dtype for t in tensors}) > 1 or on_cpu
