"""In-place per-head compaction of a request's paged slots, and the paged gather.

Compaction: for every (request r, KV head h), slot j (j < b_r) receives the contents of slot
``keep[r, h, j]`` where ``keep`` is strictly ascending per head.

Why one program may copy in place, tile after tile, without a scratch copy
(ascending ``keep`` implies ``keep[j] >= j``):
  * a tile T = [t0, t1) reads slots keep[t0:t1], all >= t0, and writes slots [t0, t1);
  * every earlier tile wrote only slots < t0, so T never reads a slot that was already overwritten;
  * a slot s that T writes may still be read by T itself (keep[j'] = s with j' < s in T): the tile is
    loaded completely, then a barrier, then stored; or by an *earlier* tile, whose loads completed
    before its own stores, which precede the barrier of every later tile.
Programs run in parallel only over (request, head, column block): those touch disjoint elements, so
the proof above is per program. Entries with keep[j] == j are skipped (no load, no store).
Every layout works because the kernel addresses elements through the four strides of the view (NHD,
HND, and the CPU backend's transposed K tiles alike); state buffers are views with d = 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import as_view4, slot_offsets, table_2d


@triton.jit
def _compact_kernel(cache_ptr, bt_ptr, bt_stride, keep_ptr, keep_s_r, keep_s_h, counts_ptr,
                    block_size, s_blk, s_head, s_tok, s_dim, D,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    col_off = cols.to(tl.int64) * s_dim
    b = tl.load(counts_ptr + r)
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    keep_row = keep_ptr + r.to(tl.int64) * keep_s_r + h * keep_s_h
    base = cache_ptr + h.to(tl.int64) * s_head
    for t0 in range(0, b, BLOCK_T):
        j = t0 + tl.arange(0, BLOCK_T)
        jmask = j < b
        src = tl.load(keep_row + j, mask=jmask, other=0)
        move = jmask & (src != j)
        src_off = slot_offsets(bt_row, src, block_size, s_blk, s_tok, move)
        dst_off = slot_offsets(bt_row, j, block_size, s_blk, s_tok, move)
        m2 = move[:, None] & cmask[None, :]
        x = tl.load(base + src_off[:, None] + col_off[None, :], mask=m2)
        tl.debug_barrier()  # the whole tile is read before any of it is written
        tl.store(base + dst_off[:, None] + col_off[None, :], x, mask=m2)


def compact(caches: list[Tensor], block_table: Tensor, keep: Tensor, counts: Tensor | None = None) -> None:
    """Triton in-place compaction. ``block_table`` [R, P] (or 1-D for one request), ``keep``
    [R, H, b_max] (or [H, b]) ascending per head, ``counts`` [R] kept per request (default b_max)."""
    if keep.numel() == 0:
        return
    bt = table_2d(block_table)
    if keep.dim() == 2:
        keep = keep.unsqueeze(0)
    n_req, h, b_max = keep.shape
    device = caches[0].device
    keep = keep.to(device=device, dtype=torch.int64)
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    if counts is None:
        counts = torch.full((n_req,), b_max, dtype=torch.int64, device=device)
    counts = counts.to(device=device, dtype=torch.int64)
    bt = bt.to(device)
    for cache in caches:
        s_blk, s_head, s_tok, s_dim, d = as_view4(cache)
        bd = min(64, max(1, triton.next_power_of_2(d)))
        grid = (n_req, h, triton.cdiv(d, bd))
        _compact_kernel[grid](cache, bt, bt.stride(0), keep, keep.stride(0), keep.stride(1), counts,
                              cache.shape[2], s_blk, s_head, s_tok, s_dim, d,
                              BLOCK_T=32, BLOCK_D=bd, num_stages=1)


@triton.jit
def _gather_kernel(cache_ptr, bt_ptr, out_ptr, length, block_size, s_blk, s_head, s_tok, s_dim, D,
                   o_s_h, o_s_t, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < length
    m2 = tmask[:, None] & (cols < D)[None, :]
    off = slot_offsets(bt_ptr, t, block_size, s_blk, s_tok, tmask) + h.to(tl.int64) * s_head
    x = tl.load(cache_ptr + off[:, None] + cols.to(tl.int64)[None, :] * s_dim, mask=m2)
    dst = out_ptr + h.to(tl.int64) * o_s_h + t.to(tl.int64)[:, None] * o_s_t + cols[None, :]
    tl.store(dst, x, mask=m2)


def gather(cache: Tensor, block_ids: Tensor, length: int) -> Tensor:
    """[num_blocks, H, bs, *rest] -> [H, length, *rest] (contiguous copy), as ``paged.gather_tokens``."""
    h = cache.shape[1]
    rest = tuple(cache.shape[3:])
    if len(rest) > 1:
        raise ValueError("the Triton gather takes [nb, H, bs, d] views or [nb, H, bs] state buffers")
    s_blk, s_head, s_tok, s_dim, d = as_view4(cache)
    out = torch.empty((h, length, d), dtype=cache.dtype, device=cache.device)
    if length > 0:
        ids = block_ids.to(cache.device).contiguous()
        bd = min(128, max(1, triton.next_power_of_2(d)))
        grid = (h, triton.cdiv(length, 32), triton.cdiv(d, bd))
        _gather_kernel[grid](cache, ids, out, length, cache.shape[2], s_blk, s_head, s_tok, s_dim, d,
                             out.stride(0), out.stride(1), BLOCK_T=32, BLOCK_D=bd)
    return out.view(h, length, *rest)
