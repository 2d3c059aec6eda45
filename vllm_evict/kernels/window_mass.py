"""Observation-window attention mass over the paged keys, GQA inside the kernel, in two passes.

Pass 1 (grid: request x query head x window-row tile) streams the request's keys page by page and
keeps an online row max and sum of exponentials per window query: the row's log-sum-exp (base 2).
Pass 2 (grid: request x KV head x key tile) loads one key tile once, recomputes the logits of every
window query of the G query heads of that KV head, turns them into probabilities with the stored LSE
and sums them over the window (and over the group): the column sums of
``vllm_evict.policies.attention.attention_column_sums``.

Causality compares logical positions: window query i sees slot j iff ``pos[j] <= qpos[i]``; ``pos``
comes from a paged per-slot position buffer, or is the slot index when none is given. The logits are
``gain_i * scale * q_i . k_j`` (``gain`` optional per packed query row: AhaKV). A row with no visible
key contributes nothing. Logits are accumulated in fp32 (fp32 operands use IEEE products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import as_view4, block_d, dot_precision, max_len_of, needs_upcast, slot_offsets, table_2d

LOG2E = 1.4426950408889634


@triton.jit
def _load_queries(q_ptr, q_start, rows, rmask, hq, qs_t, qs_h, qs_d, dcols, dmask,
                  qpos_ptr, gain_ptr, scale, HAS_GAIN: tl.constexpr):
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * qs_t + hq * qs_h + dcols[None, :] * qs_d,
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    qpos = tl.load(qpos_ptr + tok, mask=rmask, other=0)
    coef = tl.zeros(rows.shape, tl.float32) + scale * 1.4426950408889634
    if HAS_GAIN:
        coef = coef * tl.load(gain_ptr + tok, mask=rmask, other=0.0).to(tl.float32)
    return q, qpos, coef


@triton.jit
def _load_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask,
               pos_ptr, p_blk, p_head, p_tok, HAS_POS: tl.constexpr):
    off = slot_offsets(bt_row, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    k = tl.load(k_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    if HAS_POS:
        poff = slot_offsets(bt_row, slots, block_size, p_blk, p_tok, nmask) + h.to(tl.int64) * p_head
        kpos = tl.load(pos_ptr + poff, mask=nmask, other=0).to(tl.int64)
    else:
        kpos = slots.to(tl.int64)
    return k, kpos


@triton.jit
def _window_lse_kernel(k_ptr, bt_ptr, bt_stride, len_ptr, q_ptr, qs_t, qs_h, qs_d, qsl_ptr, qpos_ptr,
                       gain_ptr, pos_ptr, lse_ptr, lse_s_t, scale, group,
                       block_size, s_blk, s_head, s_tok, s_dim, p_blk, p_head, p_tok, D,
                       HAS_GAIN: tl.constexpr, HAS_POS: tl.constexpr, UPCAST: tl.constexpr,
                       PREC: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    hq = tl.program_id(1)
    q_start = tl.load(qsl_ptr + r)
    w = tl.load(qsl_ptr + r + 1) - q_start
    rows = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    if tl.program_id(2) * BLOCK_W < w:
        rmask = rows < w
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        q, qpos, coef = _load_queries(q_ptr, q_start, rows, rmask, hq, qs_t, qs_h, qs_d, dcols, dmask,
                                      qpos_ptr, gain_ptr, scale, HAS_GAIN)
        if UPCAST:
            q = q.to(tl.float32)
        h = hq // group
        length = tl.load(len_ptr + r)
        bt_row = bt_ptr + r.to(tl.int64) * bt_stride
        m = tl.full((BLOCK_W,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_W,), tl.float32)
        for n0 in range(0, length, BLOCK_N):
            slots = n0 + tl.arange(0, BLOCK_N)
            nmask = slots < length
            k, kpos = _load_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                                 dcols, dmask, pos_ptr, p_blk, p_head, p_tok, HAS_POS)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * coef[:, None]
            visible = nmask[None, :] & (kpos[None, :] <= qpos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + (q_start + rows).to(tl.int64) * lse_s_t + hq, lse, mask=rmask)


@triton.jit
def _window_colsum_kernel(k_ptr, bt_ptr, bt_stride, len_ptr, q_ptr, qs_t, qs_h, qs_d, qsl_ptr, qpos_ptr,
                          gain_ptr, pos_ptr, lse_ptr, lse_s_t, out_ptr, o_s_r, o_s_h, o_s_g, scale, group,
                          block_size, s_blk, s_head, s_tok, s_dim, p_blk, p_head, p_tok, D,
                          HAS_GAIN: tl.constexpr, HAS_POS: tl.constexpr, UPCAST: tl.constexpr,
                          PREC: tl.constexpr, REDUCE: tl.constexpr, BLOCK_W: tl.constexpr,
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
        k, kpos = _load_keys(k_ptr, bt_row, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                             dcols, dmask, pos_ptr, p_blk, p_head, p_tok, HAS_POS)
        if UPCAST:
            k = k.to(tl.float32)
        q_start = tl.load(qsl_ptr + r)
        w = tl.load(qsl_ptr + r + 1) - q_start
        out_row = out_ptr + r.to(tl.int64) * o_s_r + h * o_s_h
        total = tl.zeros((BLOCK_N,), tl.float32)
        for g in range(0, group):
            hq = h * group + g
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for w0 in range(0, w, BLOCK_W):
                rows = w0 + tl.arange(0, BLOCK_W)
                rmask = rows < w
                q, qpos, coef = _load_queries(q_ptr, q_start, rows, rmask, hq, qs_t, qs_h, qs_d, dcols,
                                              dmask, qpos_ptr, gain_ptr, scale, HAS_GAIN)
                if UPCAST:
                    q = q.to(tl.float32)
                lse = tl.load(lse_ptr + (q_start + rows).to(tl.int64) * lse_s_t + hq, mask=rmask,
                              other=float("-inf"))
                live = rmask & (lse != float("-inf"))
                lse = tl.where(live, lse, 0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * coef[:, None]
                visible = live[:, None] & nmask[None, :] & (kpos[None, :] <= qpos[:, None])
                p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
                acc += tl.sum(p, axis=0)
            if REDUCE:
                total += acc
            else:
                tl.store(out_row + g * o_s_g + slots, acc, mask=nmask)
        if REDUCE:
            tl.store(out_row + slots, total, mask=nmask)


def window_attention_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                          query_start_loc: Tensor, query_positions: Tensor, scale: float,
                          positions: Tensor | None = None, gain: Tensor | None = None,
                          reduce_group: bool = True, max_len: int | None = None,
                          block_n: int = 64, block_w: int = 16) -> Tensor:
    """Triton version of ``paged.paged_window_attention_mass`` (same arguments and result)."""
    device = k_cache.device
    bt = table_2d(block_table).to(device)
    lengths = lengths.to(device=device, dtype=torch.int64)
    qsl = query_start_loc.to(device=device, dtype=torch.int64)
    qpos = query_positions.to(device=device, dtype=torch.int64)
    n_req = lengths.shape[0]
    h_kv = k_cache.shape[1]
    t, h_q, d = queries.shape
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads do not form groups over {h_kv} KV heads")
    group = h_q // h_kv
    width = max_len_of(lengths, max_len)
    shape = (n_req, h_kv, width) if reduce_group else (n_req, h_kv, group, width)
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    if width == 0 or t == 0 or n_req == 0:
        return out
    max_w = int((qsl[1:] - qsl[:-1]).max().item())
    s_blk, s_head, s_tok, s_dim, _ = as_view4(k_cache)
    if positions is not None:
        p_blk, p_head, p_tok = positions.stride(0), positions.stride(1), positions.stride(2)
    else:
        p_blk = p_head = p_tok = 0
    lse = torch.empty((t, h_q), dtype=torch.float32, device=device)
    gain_t = gain.to(device=device, dtype=torch.float32).contiguous() if gain is not None else lse
    upcast = needs_upcast(queries, k_cache)
    prec = "ieee" if upcast else dot_precision(queries, k_cache)
    common = dict(HAS_GAIN=gain is not None, HAS_POS=positions is not None, UPCAST=upcast, PREC=prec,
                  BLOCK_W=block_w, BLOCK_N=block_n, BLOCK_D=block_d(d))
    pos_arg = positions if positions is not None else lengths
    _window_lse_kernel[(n_req, h_q, triton.cdiv(max_w, block_w))](
        k_cache, bt, bt.stride(0), lengths, queries, *queries.stride(), qsl, qpos, gain_t, pos_arg,
        lse, lse.stride(0), float(scale), group, k_cache.shape[2], s_blk, s_head, s_tok, s_dim,
        p_blk, p_head, p_tok, d, **common)
    o_s_g = out.stride(2) if not reduce_group else 0
    _window_colsum_kernel[(n_req, h_kv, triton.cdiv(width, block_n))](
        k_cache, bt, bt.stride(0), lengths, queries, *queries.stride(), qsl, qpos, gain_t, pos_arg,
        lse, lse.stride(0), out, out.stride(0), out.stride(1), o_s_g, float(scale), group,
        k_cache.shape[2], s_blk, s_head, s_tok, s_dim, p_blk, p_head, p_tok, d, REDUCE=reduce_group,
        **common)
    return out
