"""CAOTE / FastCAOTE value term over the paged values (policies/caote.py, group mode), two passes.

Given α [R, H_kv, n] (the normalised base scores, ``caote.normalise_mass``):
pass 1 (grid: request x KV head x chunk) sums α_j v_j (CAOTE) or v_j (FastCAOTE) per chunk into fp32
partials, added in a fixed order afterwards: X (divided by n for FastCAOTE);
pass 2 (grid: request x KV head x slot tile) writes c_j = α_j / max(1 − α_j, eps) · ||X − v_j||₂,
+inf where 1 − α_j < eps (the direct difference, never the expanded square, spec caote.md §3.8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import as_view4, block_d, slot_offsets, table_2d


@triton.jit
def _load_values(v_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask):
    off = slot_offsets(bt_row, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    return tl.load(v_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                   mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _caote_sum_kernel(v_ptr, bt_ptr, bt_stride, len_ptr, a_ptr, a_s_r, a_s_h, part_ptr, pt_s_r, pt_s_h,
                      pt_s_c, block_size, s_blk, s_head, s_tok, s_dim, D, chunk,
                      FAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    length = tl.load(len_ptr + r)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    a_row = a_ptr + r.to(tl.int64) * a_s_r + h * a_s_h
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = c * chunk
    stop = tl.minimum(start + chunk, length)
    for n0 in range(start, stop, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        nmask = slots < stop
        v = _load_values(v_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask)
        if FAST:
            acc += tl.sum(v, axis=0)
        else:
            a = tl.load(a_row + slots, mask=nmask, other=0.0).to(tl.float32)
            acc += tl.sum(v * a[:, None], axis=0)
    tl.store(part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + c * pt_s_c + dcols, acc, mask=dmask)


@triton.jit
def _caote_score_kernel(v_ptr, bt_ptr, bt_stride, len_ptr, a_ptr, a_s_r, a_s_h, x_ptr, x_s_r, x_s_h,
                        out_ptr, o_s_r, o_s_h, block_size, s_blk, s_head, s_tok, s_dim, D, eps,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(len_ptr + r)
    slots = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(2) * BLOCK_N < length:
        nmask = slots < length
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        bt_row = bt_ptr + r.to(tl.int64) * bt_stride
        v = _load_values(v_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask)
        x = tl.load(x_ptr + r.to(tl.int64) * x_s_r + h * x_s_h + dcols, mask=dmask, other=0.0)
        diff = tl.where(dmask[None, :], x[None, :] - v, 0.0)
        dist = tl.sqrt(tl.sum(diff * diff, axis=1))
        a = tl.load(a_ptr + r.to(tl.int64) * a_s_r + h * a_s_h + slots, mask=nmask, other=0.0).to(tl.float32)
        one_minus = 1.0 - a
        c = a / tl.maximum(one_minus, eps) * dist
        c = tl.where(one_minus < eps, float("inf"), c)
        tl.store(out_ptr + r.to(tl.int64) * o_s_r + h * o_s_h + slots, c, mask=nmask)


def caote_scores(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor, fast: bool = False,
                 eps: float = 1e-6, block_n: int = 64, chunk: int = 1024) -> Tensor:
    """Triton version of ``paged.paged_caote_scores``: fp32 [R, H_kv, alpha.shape[2]], -inf padding."""
    device = v_cache.device
    bt = table_2d(block_table).to(device)
    lengths = lengths.to(device=device, dtype=torch.int64)
    n_req, h_kv = lengths.shape[0], v_cache.shape[1]
    width = alpha.shape[2]
    out = torch.full((n_req, h_kv, width), float("-inf"), dtype=torch.float32, device=device)
    if width == 0 or n_req == 0:
        return out
    alpha = alpha.to(device)
    if alpha.stride(-1) != 1:
        alpha = alpha.contiguous()
    s_blk, s_head, s_tok, s_dim, d = as_view4(v_cache)
    chunk = max(block_n, chunk // block_n * block_n)
    n_chunks = triton.cdiv(width, chunk)
    part = torch.zeros((n_req, h_kv, n_chunks, d), dtype=torch.float32, device=device)
    bd = block_d(d)
    _caote_sum_kernel[(n_req, h_kv, n_chunks)](
        v_cache, bt, bt.stride(0), lengths, alpha, alpha.stride(0), alpha.stride(1), part, part.stride(0),
        part.stride(1), part.stride(2), v_cache.shape[2], s_blk, s_head, s_tok, s_dim, d, chunk,
        FAST=fast, BLOCK_N=block_n, BLOCK_D=bd)
    x = part.sum(dim=2)
    if fast:
        x = x / lengths.clamp_min(1).view(-1, 1, 1).float()
    _caote_score_kernel[(n_req, h_kv, triton.cdiv(width, block_n))](
        v_cache, bt, bt.stride(0), lengths, alpha, alpha.stride(0), alpha.stride(1), x, x.stride(0),
        x.stride(1), out, out.stride(0), out.stride(1), v_cache.shape[2], s_blk, s_head, s_tok, s_dim, d,
        float(eps), BLOCK_N=block_n, BLOCK_D=bd)
    return out
