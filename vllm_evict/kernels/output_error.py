"""CAOTE's output error over the paged values, two passes (``dense.output_error``).

Given normalised base weights α [R, H_kv, N] (``dense.normalise_mass``, 0 on padding):
pass 1 (grid: row x KV head x chunk of slots) sums α_j v_j (CAOTE) or v_j (FastCAOTE) of a chunk into
an fp32 partial;
pass 2 (grid: row x KV head x slot tile) adds the row's partials in a fixed order into the centre X
(divided by the row's length for FastCAOTE) and writes α_j / max(1 − α_j, eps) · ‖X − v_j‖₂, +inf where
1 − α_j < eps (the direct difference, never the expanded square, spec caote.md §3.8), -inf on padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import (block_d, check_index, dequantize, load_scale, per_step_jit, scale_argument, slot_offsets,
                      table_strides, view_strides)


@triton.jit
def _load_values(v_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask,
                 vscale, SCALED: tl.constexpr):
    off = slot_offsets(bt_row, bt_s_p, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    v = tl.load(v_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    return dequantize(v, vscale, SCALED).to(tl.float32)


@per_step_jit(ints=('bt_s_r', 'a_s_r', 'a_s_h', 'pt_s_r', 'pt_s_h', 'width'),
              pointers=('vs_ptr', 'bt_ptr', 'len_ptr'))
def _center_sum_kernel(v_ptr, vs_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, a_ptr, a_s_r, a_s_h, a_s_n, part_ptr,
                       pt_s_r, pt_s_h, pt_s_c, width, block_size, s_blk, s_head, s_tok, s_dim, D, chunk,
                       FAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       SCALED: tl.constexpr = False):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vscale = load_scale(vs_ptr, SCALED)
    c = tl.program_id(2)
    length = tl.minimum(tl.load(len_ptr + r.to(tl.int64) * len_s).to(tl.int64), width)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    bt_row = bt_ptr + r.to(tl.int64) * bt_s_r
    a_row = a_ptr + r.to(tl.int64) * a_s_r + h.to(tl.int64) * a_s_h
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = c * chunk
    stop = tl.minimum(start + chunk, length)
    for n0 in range(start, stop, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        nmask = slots < stop
        v = _load_values(v_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols,
                         dmask, vscale, SCALED)
        if FAST:
            acc += tl.sum(v, axis=0)
        else:
            a = tl.load(a_row + slots.to(tl.int64) * a_s_n, mask=nmask, other=0.0).to(tl.float32)
            acc += tl.sum(v * a[:, None], axis=0)
    # Every chunk is written (zeros past the row's length): pass 2 adds them all without a mask.
    tl.store(part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + c * pt_s_c + dcols, acc, mask=dmask)


@per_step_jit(ints=('bt_s_r', 'a_s_r', 'a_s_h', 'pt_s_r', 'pt_s_h', 'n_chunks', 'o_s_r', 'o_s_h', 'width'),
              pointers=('vs_ptr', 'bt_ptr', 'len_ptr'))
def _output_error_kernel(v_ptr, vs_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, a_ptr, a_s_r, a_s_h, a_s_n, part_ptr,
                         pt_s_r, pt_s_h, pt_s_c, n_chunks, out_ptr, o_s_r, o_s_h, width, block_size, s_blk,
                         s_head, s_tok, s_dim, D, eps,
                         FAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SCALED: tl.constexpr = False):
    r = tl.program_id(0)
    h = tl.program_id(1)
    vscale = load_scale(vs_ptr, SCALED)
    raw_length = tl.load(len_ptr + r.to(tl.int64) * len_s).to(tl.int64)
    length = tl.minimum(raw_length, width)
    slots = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_row = out_ptr + r.to(tl.int64) * o_s_r + h.to(tl.int64) * o_s_h
    err = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if tl.program_id(2) * BLOCK_N < length:
        nmask = slots < length
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        part_row = part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + dcols
        x = tl.zeros((BLOCK_D,), tl.float32)
        for c in range(0, n_chunks):
            x += tl.load(part_row + c * pt_s_c, mask=dmask, other=0.0)
        if FAST:
            x = x / tl.maximum(raw_length, 1).to(tl.float32)
        bt_row = bt_ptr + r.to(tl.int64) * bt_s_r
        v = _load_values(v_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols,
                         dmask, vscale, SCALED)
        diff = tl.where(dmask[None, :], x[None, :] - v, 0.0)
        dist = tl.sqrt(tl.sum(diff * diff, axis=1))
        a = tl.load(a_ptr + r.to(tl.int64) * a_s_r + h.to(tl.int64) * a_s_h + slots.to(tl.int64) * a_s_n,
                    mask=nmask, other=0.0).to(tl.float32)
        one_minus = 1.0 - a
        e = a / tl.maximum(one_minus, eps) * dist
        e = tl.where(one_minus < eps, float("inf"), e)
        err = tl.where(nmask, e, float("-inf"))
    tl.store(out_row + slots, err, mask=slots < width)


def output_error(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor, *, fast: bool = False,
                 eps: float = 1e-6, v_scale: Tensor | None = None, block_n: int = 64, chunk: int = 1024) -> Tensor:
    """Triton ``paged.output_error``: fp32 [R, H_kv, N] for weights ``alpha`` [R, H_kv, N] (any strides,
    any float dtype), -inf on padding. ``v_scale``: None, or the fp32 [] / [1] scale of an fp8 value cache
    (values dequantised in the kernel). ``block_n`` / ``chunk`` as in ``keydiff.keydiff_scores``."""
    check_index("block_table", block_table)
    check_index("lengths", lengths)
    rows, h_kv = lengths.shape[0], v_cache.shape[1]
    if alpha.dim() != 3 or alpha.shape[:2] != (rows, h_kv):
        raise ValueError(f"alpha must be [R, H_kv, N] = [{rows}, {h_kv}, N], got shape {tuple(alpha.shape)}")
    bt_s_r, bt_s_p = table_strides(block_table, rows)
    width = alpha.shape[2]
    out = torch.empty((rows, h_kv, width), dtype=torch.float32, device=v_cache.device)
    if width == 0 or rows == 0:
        return out
    s_blk, s_head, s_tok, s_dim, d = view_strides(v_cache)
    chunk = max(block_n, chunk // block_n * block_n)
    n_chunks = triton.cdiv(width, chunk)
    part = torch.empty((rows, h_kv, n_chunks, d), dtype=torch.float32, device=v_cache.device)
    bd = block_d(d)
    geometry = (v_cache.shape[2], s_blk, s_head, s_tok, s_dim, d)
    vs, scaled = scale_argument(v_scale, v_cache, "v_scale", part)
    common = (v_cache, vs, block_table, bt_s_r, bt_s_p, lengths, lengths.stride(0), alpha, *alpha.stride(), part,
              *part.stride()[:3])
    _center_sum_kernel[(rows, h_kv, n_chunks)](
        *common, width, *geometry, chunk, FAST=fast, BLOCK_N=block_n, BLOCK_D=bd, SCALED=scaled)
    _output_error_kernel[(rows, h_kv, triton.cdiv(width, block_n))](
        *common, n_chunks, out, out.stride(0), out.stride(1), width, *geometry, float(eps),
        FAST=fast, BLOCK_N=block_n, BLOCK_D=bd, SCALED=scaled)
    return out
