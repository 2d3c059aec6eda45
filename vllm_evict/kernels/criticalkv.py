"""CriticalKV's projected-value L1 norms for new tokens (policies/criticalkv.py ``projected_value_l1``).

Grid: request x KV head x tile of new slots. The tile's values [T, d] are loaded once from the paged
cache; for each query head h of the group and each tile of output channels, the product with the
head's slice W_O^(h) = o_proj[:, h*d:(h+1)*d]ᵀ (read in place through the weight's strides, no
re-layout) is reduced to |·| sums. The group mean ν = (1/G) Σ_h ||v W_O^(h)||₁ is written straight
into the paged per-token state buffer at the new slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import as_view4, block_d, dot_precision, needs_upcast, slot_offsets, table_2d


@triton.jit
def _nu_kernel(v_ptr, bt_ptr, bt_stride, start_ptr, end_ptr, w_ptr, w_s_out, w_s_in, out_ptr,
               block_size, s_blk, s_head, s_tok, s_dim, o_blk, o_head, o_tok, D, hidden, group,
               UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
               BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s0 = tl.load(start_ptr + r)
    s1 = tl.load(end_ptr + r)
    slots = s0 + tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    if s0 + tl.program_id(2) * BLOCK_T < s1:
        tmask = slots < s1
        dcols = tl.arange(0, BLOCK_D)
        dmask = dcols < D
        bt_row = bt_ptr + r.to(tl.int64) * bt_stride
        off = slot_offsets(bt_row, slots, block_size, s_blk, s_tok, tmask) + h.to(tl.int64) * s_head
        v = tl.load(v_ptr + off[:, None] + dcols.to(tl.int64)[None, :] * s_dim,
                    mask=tmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        total = tl.zeros((BLOCK_T,), tl.float32)
        for g in range(0, group):
            col0 = (h * group + g) * D  # first o_proj column of query head h*G+g
            for c0 in range(0, hidden, BLOCK_C):
                outs = c0 + tl.arange(0, BLOCK_C)
                w = tl.load(w_ptr + outs.to(tl.int64)[None, :] * w_s_out + (col0 + dcols).to(tl.int64)[:, None] * w_s_in,
                            mask=dmask[:, None] & (outs < hidden)[None, :], other=0.0)  # [BLOCK_D, BLOCK_C]
                if UPCAST:
                    w = w.to(tl.float32)
                y = tl.dot(v, w, input_precision=PREC)
                total += tl.sum(tl.abs(y), axis=1)
        nu = total / group
        ooff = slot_offsets(bt_row, slots, block_size, o_blk, o_tok, tmask) + h.to(tl.int64) * o_head
        tl.store(out_ptr + ooff, nu, mask=tmask)


def criticalkv_value_norms(v_cache: Tensor, block_table: Tensor, starts: Tensor, ends: Tensor, o_proj: Tensor,
                           out: Tensor, block_t: int = 32, block_c: int = 64) -> Tensor:
    """Triton version of ``paged.paged_criticalkv_value_norms``: writes ν of slots [starts[r], ends[r])
    into the paged fp32 state buffer ``out`` [num_blocks, H_kv, block_size] and returns it."""
    device = v_cache.device
    bt = table_2d(block_table).to(device)
    starts = starts.to(device=device, dtype=torch.int64)
    ends = ends.to(device=device, dtype=torch.int64)
    n_req, h_kv = starts.shape[0], v_cache.shape[1]
    s_blk, s_head, s_tok, s_dim, d = as_view4(v_cache)
    hidden, cols = o_proj.shape
    if cols % d or (cols // d) % h_kv:
        raise ValueError(f"o_proj must be [hidden, H_q*{d}] with H_q a multiple of {h_kv}, got {tuple(o_proj.shape)}")
    group = cols // d // h_kv
    if n_req == 0:
        return out
    max_new = int((ends - starts).max().item())
    if max_new <= 0:
        return out
    w = o_proj.to(device)
    upcast = needs_upcast(v_cache, w)
    prec = "ieee" if upcast else dot_precision(v_cache, w)
    _nu_kernel[(n_req, h_kv, triton.cdiv(max_new, block_t))](
        v_cache, bt, bt.stride(0), starts, ends, w, w.stride(0), w.stride(1), out,
        v_cache.shape[2], s_blk, s_head, s_tok, s_dim, out.stride(0), out.stride(1), out.stride(2),
        d, hidden, group, UPCAST=upcast, PREC=prec, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_D=block_d(d))
    return out
