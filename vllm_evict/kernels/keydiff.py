"""KeyDiff scores over the paged keys in two passes (``dense.keydiff_scores``).

Pass 1 (grid: row x KV head x chunk of slots) sums the normalised keys k̂ = k / max(‖k‖, eps) of a
chunk into an fp32 partial. Pass 2 (grid: row x KV head x slot tile) adds the row's partials in a fixed
order (deterministic, no atomics), divides by the row's length (the anchor μ) and writes −k̂ᵀμ for
every slot of the tile, -inf on padding slots up to ``width``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from vllm_evict.dense import KEY_NORM_EPS

from ._common import (block_d, check_index, dequantize, load_scale, per_step_jit, scale_argument, slot_offsets,
                      table_strides, view_strides)


@triton.jit
def _normalised_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols,
                     dmask, eps, kscale, SCALED: tl.constexpr):
    off = slot_offsets(bt_row, bt_s_p, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    k = tl.load(k_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    # k̂ is scale-free but for eps: the scale is applied so that k̂ is exactly the reference's.
    k = dequantize(k, kscale, SCALED).to(tl.float32)
    norm = tl.sqrt(tl.sum(k * k, axis=1))
    return k / tl.maximum(norm, eps)[:, None]


@per_step_jit(ints=('bt_s_r', 'pt_s_r', 'pt_s_h', 'width'),
              pointers=('ks_ptr', 'bt_ptr', 'len_ptr'))
def _keydiff_sum_kernel(k_ptr, ks_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, part_ptr, pt_s_r, pt_s_h, pt_s_c,
                        width, block_size, s_blk, s_head, s_tok, s_dim, D, chunk, eps,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr = False):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kscale = load_scale(ks_ptr, SCALED)
    c = tl.program_id(2)
    length = tl.minimum(tl.load(len_ptr + r.to(tl.int64) * len_s).to(tl.int64), width)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    bt_row = bt_ptr + r.to(tl.int64) * bt_s_r
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = c * chunk
    stop = tl.minimum(start + chunk, length)
    for n0 in range(start, stop, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        nmask = slots < stop
        khat = _normalised_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                                dcols, dmask, eps, kscale, SCALED)
        acc += tl.sum(khat, axis=0)
    # Every chunk is written (zeros past the row's length): pass 2 adds them all without a mask.
    tl.store(part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + c * pt_s_c + dcols, acc, mask=dmask)


@per_step_jit(ints=('bt_s_r', 'pt_s_r', 'pt_s_h', 'n_chunks', 'o_s_r', 'o_s_h', 'width'),
              pointers=('ks_ptr', 'bt_ptr', 'len_ptr'))
def _keydiff_score_kernel(k_ptr, ks_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, part_ptr, pt_s_r, pt_s_h, pt_s_c,
                          n_chunks, out_ptr, o_s_r, o_s_h, width, block_size, s_blk, s_head, s_tok, s_dim, D, eps,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr = False):
    r = tl.program_id(0)
    h = tl.program_id(1)
    kscale = load_scale(ks_ptr, SCALED)
    raw_length = tl.load(len_ptr + r.to(tl.int64) * len_s).to(tl.int64)
    length = tl.minimum(raw_length, width)
    slots = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_row = out_ptr + r.to(tl.int64) * o_s_r + h.to(tl.int64) * o_s_h
    score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if tl.program_id(2) * BLOCK_N < length:
        nmask = slots < length
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        part_row = part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + dcols
        mu = tl.zeros((BLOCK_D,), tl.float32)
        for c in range(0, n_chunks):
            mu += tl.load(part_row + c * pt_s_c, mask=dmask, other=0.0)
        mu = mu / tl.maximum(raw_length, 1).to(tl.float32)
        bt_row = bt_ptr + r.to(tl.int64) * bt_s_r
        khat = _normalised_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                                dcols, dmask, eps, kscale, SCALED)
        score = tl.where(nmask, -tl.sum(khat * mu[None, :], axis=1), float("-inf"))
    tl.store(out_row + slots, score, mask=slots < width)


def keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor, *, width: int,
                   k_scale: Tensor | None = None, block_n: int = 64, chunk: int = 1024) -> Tensor:
    """Triton ``paged.keydiff_scores``: fp32 [R, H_kv, width], -inf on padding.

    ``block_n``: slots per tile; ``chunk``: slots summed per program of pass 1 (tests shrink both to
    exercise the multi-chunk reduction); ``k_scale``: None, or the fp32 [] / [1] scale of an fp8 key cache."""
    check_index("block_table", block_table)
    check_index("lengths", lengths)
    rows, h_kv = lengths.shape[0], k_cache.shape[1]
    bt_s_r, bt_s_p = table_strides(block_table, rows)
    out = torch.empty((rows, h_kv, width), dtype=torch.float32, device=k_cache.device)
    if width == 0 or rows == 0:
        return out
    s_blk, s_head, s_tok, s_dim, d = view_strides(k_cache)
    chunk = max(block_n, chunk // block_n * block_n)
    n_chunks = triton.cdiv(width, chunk)
    part = torch.empty((rows, h_kv, n_chunks, d), dtype=torch.float32, device=k_cache.device)
    bd = block_d(d)
    geometry = (k_cache.shape[2], s_blk, s_head, s_tok, s_dim, d)
    ks, scaled = scale_argument(k_scale, k_cache, "k_scale", part)
    _keydiff_sum_kernel[(rows, h_kv, n_chunks)](
        k_cache, ks, block_table, bt_s_r, bt_s_p, lengths, lengths.stride(0), part, *part.stride()[:3], width,
        *geometry, chunk, KEY_NORM_EPS, BLOCK_N=block_n, BLOCK_D=bd, SCALED=scaled)
    _keydiff_score_kernel[(rows, h_kv, triton.cdiv(width, block_n))](
        k_cache, ks, block_table, bt_s_r, bt_s_p, lengths, lengths.stride(0), part, *part.stride()[:3], n_chunks,
        out, out.stride(0), out.stride(1), width, *geometry, KEY_NORM_EPS, BLOCK_N=block_n, BLOCK_D=bd,
        SCALED=scaled)
    return out
