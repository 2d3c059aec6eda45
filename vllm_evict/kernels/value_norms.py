"""CriticalKV's value norms ν of the tokens entering the cache (``dense.value_norms``).

Grid: KV head x tile of tokens. The tile's values [T, d] are loaded once from the dense values of the
step; for each query head of the KV head's group and each tile of output channels, the product with
the head's slice W_O^(h) = o_proj[:, h*d:(h+1)*d]ᵀ (read in place through the weight's strides, no
re-layout, no fp32 copy of the weight) is reduced to |·| sums. The group mean
ν = (1/G) Σ_h ‖v W_O^(h)‖₁ is written to the fp32 [H_kv, T] result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import block_d, dot_precision, needs_upcast, per_step_jit


@per_step_jit(ints=('v_s_h', 'v_s_t', 'o_s_h', 'T'),
              pointers=('v_ptr',))
def _value_norms_kernel(v_ptr, v_s_h, v_s_t, v_s_d, w_ptr, w_s_out, w_s_in, out_ptr, o_s_h, o_s_t,
                        T, D, hidden, group,
                        UPCAST: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    h = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tokens < T
    dcols = tl.arange(0, BLOCK_D)
    dmask = dcols < D
    v = tl.load(v_ptr + h.to(tl.int64) * v_s_h + tokens.to(tl.int64)[:, None] * v_s_t
                + dcols.to(tl.int64)[None, :] * v_s_d, mask=tmask[:, None] & dmask[None, :], other=0.0)
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
    tl.store(out_ptr + h.to(tl.int64) * o_s_h + tokens.to(tl.int64) * o_s_t, total / group, mask=tmask)


def value_norms(values: Tensor, o_proj: Tensor, *, block_t: int = 32, block_c: int = 64) -> Tensor:
    """Triton ``dense.value_norms``: values [H_kv, T, d] (any strides) and o_proj [hidden, H_q*d] (the
    layer's ``nn.Linear`` weight, same device) -> fp32 [H_kv, T]."""
    if values.dim() != 3:
        raise ValueError(f"values must be [H_kv, T, d], got shape {tuple(values.shape)}")
    h, t, d = values.shape
    if o_proj.dim() != 2 or o_proj.shape[1] % d != 0 or (o_proj.shape[1] // d) % h != 0:
        raise ValueError(f"o_proj must be [hidden, H_q*{d}] with H_q a multiple of {h} KV heads, "
                         f"got shape {tuple(o_proj.shape)}")
    if o_proj.device != values.device:
        raise ValueError(f"o_proj is on {o_proj.device}, the values on {values.device}: move the weight once, "
                         f"not per call")
    group = o_proj.shape[1] // d // h
    out = torch.empty((h, t), dtype=torch.float32, device=values.device)
    if t == 0 or h == 0:
        return out
    upcast = needs_upcast(values, o_proj)
    prec = "ieee" if upcast else dot_precision(values, o_proj)
    _value_norms_kernel[(h, triton.cdiv(t, block_t))](
        values, *values.stride(), o_proj, o_proj.stride(0), o_proj.stride(1), out, out.stride(0), out.stride(1),
        t, d, o_proj.shape[0], group, UPCAST=upcast, PREC=prec, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_D=block_d(d))
    return out
