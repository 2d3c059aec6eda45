"""Pieces shared by the Triton kernels: paged slot addressing and launch helpers.

Launchers pass every tensor with its own strides and never convert index tensors: block tables,
lengths, counts, positions and keep lists may be int32 or int64, and the kernels widen what they load.
So a launcher costs its kernels and its output allocations, with no copy and no host-device sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def slot_offsets(bt_row_ptr, bt_s_p, slots, block_size, s_blk, s_tok, mask):
    """Element offset (int64) of logical slots ``slots`` of one row in a paged view.

    ``bt_row_ptr`` points at the row of the block table, whose page entries are ``bt_s_p`` apart;
    slot s lives in page ``row[s // block_size]`` at token offset ``s % block_size``.
    """
    page = tl.load(bt_row_ptr + (slots // block_size).to(tl.int64) * bt_s_p, mask=mask, other=0).to(tl.int64)
    return page * s_blk + (slots % block_size).to(tl.int64) * s_tok


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


def needs_upcast(*tensors: Tensor) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 in the kernel: mixed dtypes, or CPU tensors
    (the Triton interpreter multiplies bf16 operands as raw integers)."""
    return len({t.dtype for t in tensors}) > 1 or any(t.device.type != "cuda" for t in tensors)
