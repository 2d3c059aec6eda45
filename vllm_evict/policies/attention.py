"""Attention arithmetic shared by the attention-mass policies (reference implementation).

Everything is computed in fp32. The causal mask compares logical positions, so it stays right after
compaction has reordered or dropped slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Query rows are processed in blocks of this size so that a 2k-token prefill chunk scored against a
# long cache never materialises the whole [G, m, n] probability tensor at once.
_QUERY_BLOCK = 256


def attention_column_sums(
    keys: Tensor,
    positions: Tensor,
    queries: Tensor,
    query_positions: Tensor,
    scale: float,
    gain: Tensor | float = 1.0,
) -> Tensor:
    """Sum over the given queries of their softmax attention to every candidate.

    Returns fp32 [H_kv, G, n]: for KV head h and query head g of its group, the column sums
    ``sum_i softmax_j(gain_i * scale * q_i . k_j)`` over the window rows i, with key j visible to
    query i only when ``positions[h, j] <= query_positions[i]``. ``gain`` is a scalar or a [w] tensor
    (AhaKV's length-adaptive logit gain).
    """
    h_kv, n, d = keys.shape
    h_q, w, _ = queries.shape
    group = h_q // h_kv
    out = torch.zeros(h_kv, group, n, dtype=torch.float32, device=keys.device)
    if w == 0 or n == 0:
        return out
    k = keys.float()  # [H_kv, n, d]
    q = queries.float().view(h_kv, group, w, d)
    gains = torch.as_tensor(gain, dtype=torch.float32, device=keys.device).expand(w)
    for start in range(0, w, _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, w)
        logits = torch.einsum("hgwd,hnd->hgwn", q[:, :, start:stop], k)
        logits = logits * (scale * gains[start:stop]).view(1, 1, -1, 1)
        visible = positions.view(h_kv, 1, 1, n) <= query_positions[start:stop].view(1, 1, -1, 1)
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no visible key contributes 0
        out += probs.sum(dim=2)
    return out


def pool1d(scores: Tensor, kernel: int, kind: str) -> Tensor:
    """Smooth [..., n] along the token axis with stride 1 and 'same' padding (``kind``: avg | max | none).

    Average pooling divides by the full kernel, as PyTorch's ``avg_pool1d(k, 1, k // 2)`` does.
    """
    if kind == "none" or kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if kind == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif kind == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"unknown pooling {kind!r}; choose avg, max or none")
    return pooled.reshape(shape)


def order_by_position(positions: Tensor) -> Tensor:
    """Per-head permutation that sorts candidates by logical position (for position-aware pooling)."""
    return torch.argsort(positions, dim=-1, stable=True)


def pool_in_position_order(scores: Tensor, positions: Tensor, kernel: int, kind: str) -> Tensor:
    """Pool [H_kv, ..., n] scores along the logical token order, whatever the slot order is."""
    if kind == "none" or kernel <= 1:
        return scores
    order = order_by_position(positions)  # [H_kv, n]
    idx = order.view(order.shape[0], *([1] * (scores.dim() - 2)), order.shape[-1]).expand_as(scores)
    ordered = torch.gather(scores, -1, idx)
    pooled = pool1d(ordered, kernel, kind)
    return torch.empty_like(pooled).scatter_(-1, idx, pooled)
