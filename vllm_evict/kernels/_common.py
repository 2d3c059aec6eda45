"""Pieces shared by the Triton kernels: paged slot addressing and launch helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def slot_offsets(bt_row_ptr, slots, block_size, s_blk, s_tok, mask):
    """Element offset (int64) of logical slots ``slots`` of one request in a paged view.

    ``bt_row_ptr`` points at the request's row of the block table; slot s lives in page
    ``row[s // block_size]`` at token offset ``s % block_size``.
    """
    page = tl.load(bt_row_ptr + slots // block_size, mask=mask, other=0).to(tl.int64)
    return page * s_blk + (slots % block_size).to(tl.int64) * s_tok


def as_view4(cache: Tensor) -> tuple[int, int, int, int, int]:
    """(s_blk, s_head, s_tok, s_dim, d) of a [nb, H, bs, d] view, or of a [nb, H, bs] state buffer
    treated as d = 1."""
    if cache.dim() == 3:
        return cache.stride(0), cache.stride(1), cache.stride(2), 0, 1
    if cache.dim() != 4:
        raise ValueError(f"expected a [num_blocks, H, block_size, d] view or a [num_blocks, H, block_size] "
                         f"state buffer, got shape {tuple(cache.shape)}")
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.shape[3]


def block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def dot_precision(*tensors: Tensor) -> str:
    """fp32 operands must not be rounded to tf32 (scores are compared to an fp32 reference)."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def table_2d(block_table: Tensor) -> Tensor:
    if block_table.dim() == 1:
        block_table = block_table.unsqueeze(0)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return block_table


def max_len_of(lengths: Tensor, max_len: int | None) -> int:
    if max_len is not None:
        return int(max_len)
    return int(lengths.max().item()) if lengths.numel() else 0


def needs_upcast(*tensors: Tensor) -> bool:
    """Whether ``tl.dot`` operands must be cast to fp32 in the kernel: mixed dtypes, or CPU tensors
    (the Triton interpreter multiplies bf16 operands as raw integers)."""
    return len({t.dtype for t in tensors}) > 1 or any(t.device.type != "cuda" for t in tensors)
