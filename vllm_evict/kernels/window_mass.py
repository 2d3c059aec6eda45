"""Observation-window attention mass over the paged keys, GQA inside the kernel, in two passes
(``dense.window_mass`` / ``paged.window_mass``).

The window is padded per row: queries [R, W, H_q, d] with positions [R, W] (-1: empty entry, sees no
key), W fixed per call, so every grid size is a host int and nothing synchronises.

Pass 1 (grid: row x query head x tile of window entries) streams the row's keys page by page and keeps
an online max and sum of exponentials per window entry: the entry's log-sum-exp (base 2).
Pass 2 (grid: row x KV head x key tile) loads one key tile once, recomputes the logits of every window
entry of the G query heads of that KV head, turns them into probabilities with the stored LSE and sums
them over the window (and over the group unless ``per_query_head``); tiles past the row's length
write the zeros of the padding, so the result needs no fill.

``accumulate_window_mass`` is the same two passes with pass 2 adding its sums into a paged per-token state
(the engine's window mass, [num_pages, H_kv, bs] or [num_pages, H_kv, bs, G]) at the row's slots instead of
writing a dense result: the window pass and its softmax fused with the state's update, no gather and no
scatter, and nothing written for padding.

Causality compares logical positions: entry i sees slot j iff ``positions[j] <= query_positions[i]``.
The logits are ``gain_i * scale * q_i . k_j`` (``gain`` [R, W] optional: AhaKV). An entry with no
visible key contributes nothing. Logits accumulate in fp32 (fp32 operands use IEEE products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import (block_d, check_index, dequantize, dot_precision, load_scale, needs_upcast, per_step_jit,
                      scale_argument, slot_offsets, table_strides, view_strides)


@triton.jit
def _load_queries(q_row, qs_w, qs_h, qs_d, entries, emask, hq, dcols, dmask, qpos_row, qp_s_w, gain_row, g_s_w,
                  scale, HAS_GAIN: tl.constexpr):
    """Window entries ``entries`` of query head ``hq`` of one row: (q [BW, BD], positions, base-2 coefficient)."""
    q = tl.load(q_row + entries.to(tl.int64)[:, None] * qs_w + hq.to(tl.int64) * qs_h
                + dcols.to(tl.int64)[None, :] * qs_d, mask=emask[:, None] & dmask[None, :], other=0.0)
    qpos = tl.load(qpos_row + entries.to(tl.int64) * qp_s_w, mask=emask, other=-1).to(tl.int64)
    coef = tl.zeros(entries.shape, tl.float32) + scale * 1.4426950408889634
    if HAS_GAIN:
        coef = coef * tl.load(gain_row + entries.to(tl.int64) * g_s_w, mask=emask, other=0.0).to(tl.float32)
    return q, qpos, coef


@triton.jit
def _load_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim, dcols, dmask,
               pos_ptr, p_blk, p_head, p_tok):
    off = slot_offsets(bt_row, bt_s_p, slots, block_size, s_blk, s_tok, nmask) + h.to(tl.int64) * s_head
    k = tl.load(k_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    poff = slot_offsets(bt_row, bt_s_p, slots, block_size, p_blk, p_tok, nmask) + h.to(tl.int64) * p_head
    kpos = tl.load(pos_ptr + poff, mask=nmask, other=0).to(tl.int64)
    return k, kpos


@triton.jit
def _dot_keys(k, kscale, q_ptr, SCALED: tl.constexpr, UPCAST: tl.constexpr):
    """Loaded keys as ``tl.dot`` operands: fp8 keys dequantised (fp32 times the scale), then in the queries'
    dtype on a GPU (tensor cores take bf16/fp16 pairs) or fp32 under UPCAST (the interpreter)."""
    if SCALED:
        k = dequantize(k, kscale, SCALED)
        if not UPCAST:
            k = k.to(q_ptr.dtype.element_ty)
    if UPCAST:
        k = k.to(tl.float32)
    return k


@per_step_jit(ints=('bt_s_r', 'qs_r', 'qp_s_r', 'g_s_r', 'lse_s_r', 'W', 'width'),
              pointers=('ks_ptr', 'bt_ptr', 'len_ptr', 'qpos_ptr', 'gain_ptr'))
def _window_lse_kernel(k_ptr, ks_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, q_ptr, qs_r, qs_w, qs_h, qs_d,
                       qpos_ptr, qp_s_r, qp_s_w, gain_ptr, g_s_r, g_s_w, pos_ptr, p_blk, p_head, p_tok,
                       lse_ptr, lse_s_r, lse_s_w, W, width, scale, group,
                       block_size, s_blk, s_head, s_tok, s_dim, D,
                       HAS_GAIN: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       SCALED: tl.constexpr = False):
    r = tl.program_id(0)
    hq = tl.program_id(1)
    entries = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    emask = entries < W
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    r64 = r.to(tl.int64)
    q, qpos, coef = _load_queries(q_ptr + r64 * qs_r, qs_w, qs_h, qs_d, entries, emask, hq, dcols, dmask,
                                  qpos_ptr + r64 * qp_s_r, qp_s_w, gain_ptr + r64 * g_s_r, g_s_w, scale, HAS_GAIN)
    if UPCAST:
        q = q.to(tl.float32)
    h = hq // group
    kscale = load_scale(ks_ptr, SCALED)
    length = tl.minimum(tl.load(len_ptr + r64 * len_s).to(tl.int64), width)
    bt_row = bt_ptr + r64 * bt_s_r
    m = tl.full((BLOCK_W,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_W,), tl.float32)
    for n0 in range(0, length, BLOCK_N):
        slots = n0 + tl.arange(0, BLOCK_N)
        nmask = slots < length
        k, kpos = _load_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                             dcols, dmask, pos_ptr, p_blk, p_head, p_tok)
        k = _dot_keys(k, kscale, q_ptr, SCALED, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * coef[:, None]
        visible = nmask[None, :] & (kpos[None, :] <= qpos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + r64 * lse_s_r + entries.to(tl.int64) * lse_s_w + hq, lse, mask=emask)


@per_step_jit(ints=('bt_s_r', 'qs_r', 'qp_s_r', 'g_s_r', 'lse_s_r', 'W', 'width', 'o_s_r', 'o_s_h', 'o_s_g'),
              pointers=('ks_ptr', 'bt_ptr', 'len_ptr', 'qpos_ptr', 'gain_ptr'))
def _window_colsum_kernel(k_ptr, ks_ptr, bt_ptr, bt_s_r, bt_s_p, len_ptr, len_s, q_ptr, qs_r, qs_w, qs_h, qs_d,
                          qpos_ptr, qp_s_r, qp_s_w, gain_ptr, g_s_r, g_s_w, pos_ptr, p_blk, p_head, p_tok,
                          lse_ptr, lse_s_r, lse_s_w, out_ptr, o_s_r, o_s_h, o_s_g, W, width, scale, group,
                          block_size, s_blk, s_head, s_tok, s_dim, D,
                          HAS_GAIN: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, REDUCE: tl.constexpr,
                          BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          ACCUMULATE: tl.constexpr = False, SCALED: tl.constexpr = False):
    # ACCUMULATE: out_ptr is a paged state with strides (o_s_r, o_s_h, o_s_g) = (page, head, token), and per
    # query head its last axis 1 apart; the sums are added at the row's slots below its length.
    r = tl.program_id(0)
    h = tl.program_id(1)
    r64 = r.to(tl.int64)
    length = tl.minimum(tl.load(len_ptr + r64 * len_s).to(tl.int64), width)
    slots = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    smask = slots < width
    out_row = out_ptr + r64 * o_s_r + h.to(tl.int64) * o_s_h
    if tl.program_id(2) * BLOCK_N < length:
        nmask = slots < length
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        bt_row = bt_ptr + r64 * bt_s_r
        k, kpos = _load_keys(k_ptr, bt_row, bt_s_p, slots, nmask, h, block_size, s_blk, s_head, s_tok, s_dim,
                             dcols, dmask, pos_ptr, p_blk, p_head, p_tok)
        k = _dot_keys(k, load_scale(ks_ptr, SCALED), q_ptr, SCALED, UPCAST)
        total = tl.zeros((BLOCK_N,), tl.float32)
        if ACCUMULATE:
            state_at = slot_offsets(bt_row, bt_s_p, slots, block_size, o_s_r, o_s_g, nmask) + h.to(tl.int64) * o_s_h
        for g in range(0, group):
            hq = h * group + g
            acc = tl.zeros((BLOCK_N,), tl.float32)
            for w0 in range(0, W, BLOCK_W):
                entries = w0 + tl.arange(0, BLOCK_W)
                emask = entries < W
                q, qpos, coef = _load_queries(q_ptr + r64 * qs_r, qs_w, qs_h, qs_d, entries, emask, hq, dcols,
                                              dmask, qpos_ptr + r64 * qp_s_r, qp_s_w, gain_ptr + r64 * g_s_r,
                                              g_s_w, scale, HAS_GAIN)
                if UPCAST:
                    q = q.to(tl.float32)
                lse = tl.load(lse_ptr + r64 * lse_s_r + entries.to(tl.int64) * lse_s_w + hq, mask=emask,
                              other=float("-inf"))
                live = emask & (lse != float("-inf"))
                lse = tl.where(live, lse, 0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * coef[:, None]
                visible = live[:, None] & nmask[None, :] & (kpos[None, :] <= qpos[:, None])
                p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
                acc += tl.sum(p, axis=0)
            if REDUCE:
                total += acc
            elif ACCUMULATE:
                at = out_ptr + state_at * group + g
                tl.store(at, tl.load(at, mask=nmask, other=0.0) + acc, mask=nmask)
            else:
                tl.store(out_row + g * o_s_g + slots, acc, mask=smask)
        if REDUCE and ACCUMULATE:
            tl.store(out_ptr + state_at, tl.load(out_ptr + state_at, mask=nmask, other=0.0) + total, mask=nmask)
        elif REDUCE:
            tl.store(out_row + slots, total, mask=smask)
    elif not ACCUMULATE:  # a tile of padding: the zeros the result was not filled with
        zeros = tl.zeros((BLOCK_N,), tl.float32)
        if REDUCE:
            tl.store(out_row + slots, zeros, mask=smask)
        else:
            for g in range(0, group):
                tl.store(out_row + g * o_s_g + slots, zeros, mask=smask)


def _validate(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
              positions: Tensor, gain: Tensor | None) -> int:
    """Check the pass's inputs (shapes, index dtypes); returns the GQA group size G."""
    for name, t in (("block_table", block_table), ("lengths", lengths), ("query_positions", query_positions),
                    ("positions", positions)):
        check_index(name, t)
    rows, h_kv = lengths.shape[0], k_cache.shape[1]
    if queries.dim() != 4 or queries.shape[0] != rows:
        raise ValueError(f"queries must be [R, W, H_q, d] with R = {rows}, got shape {tuple(queries.shape)}")
    w, h_q = queries.shape[1], queries.shape[2]
    if query_positions.shape != (rows, w):
        raise ValueError(f"query_positions must be [R, W] = [{rows}, {w}], got shape {tuple(query_positions.shape)}")
    if gain is not None and gain.shape != (rows, w):
        raise ValueError(f"gain must be None or [R, W] = [{rows}, {w}], got shape {tuple(gain.shape)}")
    if h_q % h_kv:
        raise ValueError(f"{h_q} query heads do not form groups over {h_kv} KV heads")
    if positions.dim() != 3 or positions.shape != k_cache.shape[:3]:
        raise ValueError(f"positions must be [num_pages, H_kv, page_size] = {tuple(k_cache.shape[:3])}, "
                         f"got shape {tuple(positions.shape)}")
    return h_q // h_kv


def _lse_pass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
              scale: float, positions: Tensor, width: int, gain: Tensor | None, group: int, block_n: int,
              block_w: int, k_scale: Tensor | None = None) -> tuple[tuple, tuple, dict]:
    """The first pass (each query's log-sum-exp over its visible keys), launched; returns the arguments
    the column-sum pass shares with it (leading arguments, trailing geometry, meta-parameters)."""
    rows, w, h_q, d = lengths.shape[0], queries.shape[1], queries.shape[2], queries.shape[3]
    bt_s_r, bt_s_p = table_strides(block_table, rows)
    s_blk, s_head, s_tok, s_dim, _ = view_strides(k_cache)
    lse = torch.empty((rows, w, h_q), dtype=torch.float32, device=k_cache.device)
    gain_t, g_s_r, g_s_w = (gain, gain.stride(0), gain.stride(1)) if gain is not None else (lse, 0, 0)
    ks, scaled = scale_argument(k_scale, k_cache, "k_scale", lse)
    # Scaled fp8 keys are dequantised into the queries' dtype in the kernel: the queries alone decide.
    dot_operands = (queries,) if scaled else (queries, k_cache)
    upcast = needs_upcast(*dot_operands)
    prec = "ieee" if upcast else dot_precision(*dot_operands)
    common = (k_cache, ks, block_table, bt_s_r, bt_s_p, lengths, lengths.stride(0), queries, *queries.stride(),
              query_positions, *query_positions.stride(), gain_t, g_s_r, g_s_w, positions, *positions.stride(),
              lse, lse.stride(0), lse.stride(1))
    geometry = (k_cache.shape[2], s_blk, s_head, s_tok, s_dim, d)
    # fp32 dot operands multiply without tensor cores: with 4 warps the 64-key tile spills at head size 128
    # (measured with benchmarks/triton_aot.py for sm_90); 8 warps hold it. bf16/fp16 fit in 4.
    meta = dict(HAS_GAIN=gain is not None, UPCAST=upcast, PREC=prec, BLOCK_W=block_w, BLOCK_N=block_n,
                BLOCK_D=block_d(d), SCALED=scaled, num_warps=8 if prec == "ieee" else 4)
    _window_lse_kernel[(rows, h_q, triton.cdiv(w, block_w))](
        *common, w, width, float(scale), group, *geometry, **meta)
    return common, geometry, meta


def window_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
                scale: float, *, positions: Tensor, width: int, gain: Tensor | None = None,
                per_query_head: bool = False, k_scale: Tensor | None = None, block_n: int = 64,
                block_w: int = 16) -> Tensor:
    """Triton ``paged.window_mass``: fp32 [R, H_kv, width] (summed over the GQA group) or
    [R, H_kv, G, width] with ``per_query_head``.

    k_cache [num_pages, H_kv, bs, d] view; block_table [R, pages]; lengths [R]; queries [R, W, H_q, d];
    query_positions [R, W] (-1: empty entry); positions [num_pages, H_kv, bs] logical position of every
    slot; gain None or fp32 [R, W]; k_scale None, or the fp32 [] / [1] scale of an fp8 key cache (keys
    dequantised in the kernel). Index tensors int32 or int64; any strides everywhere."""
    group = _validate(k_cache, block_table, lengths, queries, query_positions, positions, gain)
    rows, h_kv, w = lengths.shape[0], k_cache.shape[1], queries.shape[1]
    shape = (rows, h_kv, group, width) if per_query_head else (rows, h_kv, width)
    if width == 0 or rows == 0 or w == 0:  # no key or no query: no mass
        return torch.zeros(shape, dtype=torch.float32, device=k_cache.device)
    out = torch.empty(shape, dtype=torch.float32, device=k_cache.device)
    common, geometry, meta = _lse_pass(k_cache, block_table, lengths, queries, query_positions, scale, positions,
                                       width, gain, group, block_n, block_w, k_scale)
    o_s_g = out.stride(2) if per_query_head else 0
    _window_colsum_kernel[(rows, h_kv, triton.cdiv(width, block_n))](
        *common, out, out.stride(0), out.stride(1), o_s_g, w, width, float(scale), group, *geometry,
        REDUCE=not per_query_head, **meta)
    return out


def accumulate_window_mass(state: Tensor, k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                           query_positions: Tensor, scale: float, *, positions: Tensor, width: int,
                           gain: Tensor | None = None, k_scale: Tensor | None = None, block_n: int = 64,
                           block_w: int = 16) -> None:
    """``window_mass`` added into ``state`` in place: fp32 [num_pages, H_kv, bs] (summed over the GQA group)
    or [num_pages, H_kv, bs, G] (per query head), contiguous per token, at each row's slots below its length."""
    per_query_head = state.dim() == 4
    if state.dtype != torch.float32 or state.shape[:3] != k_cache.shape[:3] or (per_query_head and state.stride(3) != 1):
        raise ValueError(f"state must be fp32 [num_pages, H_kv, page_size(, G)] = {tuple(k_cache.shape[:3])}, "
                         f"contiguous per token; got {state.dtype} {tuple(state.shape)}")
    rows, w = lengths.shape[0], queries.shape[1]
    if width == 0 or rows == 0 or w == 0:
        return
    group = _validate(k_cache, block_table, lengths, queries, query_positions, positions, gain)
    if per_query_head and state.shape[3] != group:
        raise ValueError(f"a per-query-head state needs {group} entries per token, got {state.shape[3]}")
    common, geometry, meta = _lse_pass(k_cache, block_table, lengths, queries, query_positions, scale, positions,
                                       width, gain, group, block_n, block_w, k_scale)
    # A per-query-head state's strides are the per-token ones scaled by G (its last axis is contiguous).
    per_token = [st // (group if per_query_head else 1) for st in state.stride()[:3]]
    # The read-modify-write of the state with a logit gain spills at 4 warps in bf16/fp16 (8 bytes, sm_90,
    # benchmarks/triton_aot.py); 8 warps hold it, as they do the fp32 variants.
    if gain is not None:
        meta["num_warps"] = 8
    _window_colsum_kernel[(rows, k_cache.shape[1], triton.cdiv(width, block_n))](
        *common, state, *per_token, w, width, float(scale), group, *geometry, REDUCE=not per_query_head,
        ACCUMULATE=True, **meta)
