"""KeyDiff scores over the paged keys in two passes (policies/keydiff.py ``keydiff_scores``).

Pass 1 (grid: request x KV head x chunk) sums the L2-normalised keys k̂ = k / max(||k||, 1e-6) of a
chunk of slots into an fp32 partial; the partials are added in a fixed order (deterministic, no
atomics) and divided by the request's length: the anchor μ per (request, KV head).
Pass 2 (grid: request x KV head x key tile) writes −k̂ᵀμ for every slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import as_view4, block_d, max_len_of, slot_offsets, table_2d

EPS = 1e-6  # policies/keydiff.py EPS


@triton.jit
def _normalised_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask,
                     eps):
    off = slot_offsets(bt_row, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    k = tl.load(k_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(k * k, axis=1))
    return k / tl.maximum(norm, eps)[:, None]


@triton.jit
def _keydiff_sum_kernel(k_ptr, bt_ptr, bt_stride, len_ptr, part_ptr, pt_s_r, pt_s_h, pt_s_c,
                        block_size, s_blk, s_head, s_tok, s_dim, D, chunk, eps,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    length = tl.load(len_ptr + r)
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    bt_row = bt_ptr + r.to(tl.int64) * bt_stride
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = c * chunk
    stop = tl.minimum(start + chunk, length)
    for n0 in range(start, stop, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        nmask = slots < stop
        khat = _normalised_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                                dcols, dmask, eps)
        acc += tl.sum(khat, axis=0)
    tl.store(part_ptr + r.to(tl.int64) * pt_s_r + h * pt_s_h + c * pt_s_c + dcols, acc, mask=dmask)


@triton.jit
def _keydiff_score_kernel(k_ptr, bt_ptr, bt_stride, len_ptr, mu_ptr, mu_s_r, mu_s_h, out_ptr, o_s_r, o_s_h,
                          block_size, s_blk, s_head, s_tok, s_dim, D, eps,
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
        khat = _normalised_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                                dcols, dmask, eps)
        mu = tl.load(mu_ptr + r.to(tl.int64) * mu_s_r + h * mu_s_h + dcols, mask=dmask, other=0.0)
        score = -tl.sum(khat * mu[None, :], axis=1)
        tl.store(out_ptr + r.to(tl.int64) * o_s_r + h * o_s_h + slots, score, mask=nmask)


def keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor, max_len: int | None = None,
                   block_n: int = 64, chunk: int = 1024) -> Tensor:
    """Triton version of ``paged.paged_keydiff_scores``: fp32 [R, H_kv, max_len], -inf padding."""
    device = k_cache.device
    bt = table_2d(block_table).to(device)
    lengths = lengths.to(device=device, dtype=torch.int64)
    n_req, h_kv = lengths.shape[0], k_cache.shape[1]
    width = max_len_of(lengths, max_len)
    out = torch.full((n_req, h_kv, width), float("-inf"), dtype=torch.float32, device=device)
    if width == 0 or n_req == 0:
        return out
    s_blk, s_head, s_tok, s_dim, d = as_view4(k_cache)
    chunk = max(block_n, chunk // block_n * block_n)
    n_chunks = triton.cdiv(width, chunk)
    part = torch.zeros((n_req, h_kv, n_chunks, d), dtype=torch.float32, device=device)
    bd = block_d(d)
    _keydiff_sum_kernel[(n_req, h_kv, n_chunks)](
        k_cache, bt, bt.stride(0), lengths, part, part.stride(0), part.stride(1), part.stride(2),
        k_cache.shape[2], s_blk, s_head, s_tok, s_dim, d, chunk, EPS, BLOCK_N=block_n, BLOCK_D=bd)
    mu = part.sum(dim=2) / lengths.clamp_min(1).view(-1, 1, 1).float()
    _keydiff_score_kernel[(n_req, h_kv, triton.cdiv(width, block_n))](
        k_cache, bt, bt.stride(0), lengths, mu, mu.stride(0), mu.stride(1), out, out.stride(0), out.stride(1),
        k_cache.shape[2], s_blk, s_head, s_tok, s_dim, d, EPS, BLOCK_N=block_n, BLOCK_D=bd)
    return out
