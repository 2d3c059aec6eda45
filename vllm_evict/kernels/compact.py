"""In-place per-head compaction of every row's paged slots (``paged.compact_tokens``).

For every (row r, KV head h), slot j (j < counts[r]) receives the contents of slot ``keep[r, h, j]``,
``keep`` strictly ascending over those columns; columns >= counts[r] (``dense.topk_keep``'s sentinel
entries) are never read.

Why one program may copy in place, tile after tile, without a scratch copy
(ascending ``keep`` implies ``keep[j] >= j``):
  * a tile T = [t0, t1) reads slots keep[t0:t1], all >= t0, and writes slots [t0, t1);
  * every earlier tile wrote only slots < t0, so T never reads a slot that was already overwritten;
  * a slot s that T writes may still be read by T itself (keep[j'] = s with j' < s in T): the tile is
    loaded completely, then a barrier, then stored; or by an *earlier* tile, whose loads completed
    before its own stores, which precede the barrier of every later tile.
Programs run in parallel only over (row, head, column block): those touch disjoint elements, so the
argument above is per program. Entries with keep[j] == j are skipped (no load, no store).
Every layout works because the kernel addresses elements through the four strides of the view (NHD,
HND, and the CPU backend's transposed K tiles alike); per-token buffers are views with d = 1.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._common import check_index, per_step_jit, slot_offsets, table_strides, view_strides


@per_step_jit(ints=('bt_s_r', 'keep_s_r', 'keep_s_h', 'b_max'),
              pointers=('bt_ptr', 'keep_ptr', 'counts_ptr'))
def _compact_kernel(cache_ptr, bt_ptr, bt_s_r, bt_s_p, keep_ptr, keep_s_r, keep_s_h, keep_s_b, counts_ptr,
                    counts_s, b_max, block_size, s_blk, s_head, s_tok, s_dim, D,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    col_off = cols.to(tl.int64) * s_dim
    b = tl.minimum(tl.load(counts_ptr + r.to(tl.int64) * counts_s).to(tl.int64), b_max)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s_r
    keep_row = keep_ptr + r.to(tl.int64) * keep_s_r + h.to(tl.int64) * keep_s_h
    base = cache_ptr + h.to(tl.int64) * s_head
    for t0 in range(0, b, BLOCK_T):
        j = t0 + tl.arange(0, BLOCK_T)
        jmask = j < b
        src = tl.load(keep_row + j.to(tl.int64) * keep_s_b, mask=jmask, other=0).to(tl.int64)
        move = jmask & (src != j)
        src_off = slot_offsets(bt_row, bt_s_p, src, block_size, s_blk, s_tok, move)
        dst_off = slot_offsets(bt_row, bt_s_p, j, block_size, s_blk, s_tok, move)
        m2 = move[:, None] & cmask[None, :]
        x = tl.load(base + src_off[:, None] + col_off[None, :], mask=m2)
        tl.debug_barrier()  # the whole tile is read before any of it is written
        tl.store(base + dst_off[:, None] + col_off[None, :], x, mask=m2)


def compact_tokens(caches: list[Tensor], block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """Triton ``paged.compact_tokens``: in every tensor of ``caches`` ([num_pages, H, bs, d] views or
    [num_pages, H, bs] buffers, any strides), move slot ``keep[r, h, j]`` into slot j for j < counts[r].

    block_table [R, pages], keep [R, H, b] and counts [R]: int32 or int64, on the caches' device."""
    if keep.numel() == 0 or not caches:
        return
    if keep.dim() != 3:
        raise ValueError(f"keep must be [R, H, b], got shape {tuple(keep.shape)}")
    rows, heads, b_max = keep.shape
    for name, t in (("block_table", block_table), ("keep", keep), ("counts", counts)):
        check_index(name, t)
    if counts.shape != (rows,):
        raise ValueError(f"counts must be [R] with R = {rows}, got shape {tuple(counts.shape)}")
    bt_s_r, bt_s_p = table_strides(block_table, rows)
    for cache in caches:
        if cache.shape[1] != heads:
            raise ValueError(f"keep has {heads} heads, a cache has {cache.shape[1]} (shape {tuple(cache.shape)})")
        s_blk, s_head, s_tok, s_dim, d = view_strides(cache)
        bd = min(64, triton.next_power_of_2(d))
        _compact_kernel[(rows, heads, triton.cdiv(d, bd))](
            cache, block_table, bt_s_r, bt_s_p, keep, *keep.stride(), counts, counts.stride(0), b_max,
            cache.shape[2], s_blk, s_head, s_tok, s_dim, d, BLOCK_T=32, BLOCK_D=bd, num_stages=1)
