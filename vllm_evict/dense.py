"""Dense reference math of every score, batched over requests: the bottom of the scoring stack.

Policies (``vllm_evict/policies``), the paged references (``vllm_evict/paged.py``) and the kernel
tests all compute through these functions, so one quantity has one definition and one name:

=====================  ====================================================================
``window_mass``        softmax column sums of window queries over the candidates (attention mass)
``keydiff_scores``     KeyDiff's −k̂ᵀμ, μ the mean of the normalised keys
``output_error``       CAOTE's α/(1−α)·‖X − v_j‖, X = Σ α v (FastCAOTE: the plain mean of v)
``value_norms``        CriticalKV's ν = group mean of ‖v W_O^(h)‖₁ (per token, from its value)
``topk_keep``          the kept slots: the top ``budget`` scores per head, ascending
=====================  ====================================================================

Shapes: R requests (rows) of one layer, each with ``lengths[r]`` candidates in slots
``0..lengths[r]-1`` of a padded axis of N slots; H KV heads, G query heads per KV head, W window
queries, d head size. Slots at or beyond a row's length are padding: masses are 0 there and scores
-inf. Query positions of -1 mark empty window entries; a query sees key j iff
``positions[j] <= query_position`` (logical positions, so the causal mask survives compaction).
Everything is computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

EMPTY_QUERY = -1  # query position of an empty window entry: it sees no key
KEY_NORM_EPS = 1e-6  # floor on key norms before normalising (KeyDiff): a zero key gets k̂ = 0
# Window rows processed at once, so a long prefill chunk never materialises [R, H, G, W, N] at once.
_QUERY_BLOCK = 256
_HIDDEN = -1e30  # the logit of a key a window query does not see (window_mass)
# Elements of the [H, G, tokens, hidden] projected-value block materialised at once (64 MiB fp32).
_VALUE_NORM_BLOCK = 1 << 24


# ---- padding ---------------------------------------------------------------------------------------
def valid_slots(lengths: Tensor, n: int) -> Tensor:
    """Bool [R, 1, n]: slot j of row r holds a candidate (j < lengths[r])."""
    return torch.arange(n, device=lengths.device).view(1, 1, n) < lengths.view(-1, 1, 1)


def as_rows(value: Tensor | int | float, rows: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A per-row quantity as a [R] tensor (a Python number is broadcast).

    A number is filled in on the device (``torch.full``): ``torch.as_tensor(number, device=...)`` would
    copy it from host memory and wait for the stream on CUDA."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype).expand(rows)
    return torch.full((rows,), value, dtype=dtype, device=device)


# ---- attention mass --------------------------------------------------------------------------------
def window_mass(keys: Tensor, positions: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
                scale: float, gain: Tensor | float | None = None, per_query_head: bool = False) -> Tensor:
    """Σ over the window of softmax_j(gain · scale · q·k_j): fp32 [R, H, N] (group sum) or [R, H, G, N].

    keys [R, H, N, d]; positions [R, H, N]; lengths [R]; queries [R, H*G, W, d]; query_positions
    [R, W]; gain None, a number, [R] or [R, W] (AhaKV's length-adaptive logit gain). Each softmax runs
    over the visible candidates of the row; a query that sees none contributes nothing.
    """
    r, h, n, d = keys.shape
    w = queries.shape[2]
    group = queries.shape[1] // h
    out = torch.zeros(r, h, group, n, dtype=torch.float32, device=keys.device)
    if w == 0 or n == 0:
        return out if per_query_head else out.sum(dim=2)
    k = keys.float()
    # The scale and gain go on the queries (W x d numbers each) rather than on the W x N logits.
    factor = (scale * row_gains(gain, r, w, keys.device)).view(r, 1, 1, w, 1)
    q = queries.float().view(r, h, group, w, d) * factor
    # A padding slot's position reads as the largest there is: no query sees it.
    key_pos = torch.where(valid_slots(lengths, n), positions.view(r, h, n), torch.iinfo(positions.dtype).max)
    first_seen = key_pos.amin(dim=-1).view(r, h, 1)  # a query sees some key iff it is at or after this one
    query_pos = query_positions.to(positions.dtype)
    for start in range(0, w, _QUERY_BLOCK):
        stop = min(start + _QUERY_BLOCK, w)
        logits = torch.einsum("rhgwd,rhnd->rhgwn", q[:, :, :, start:stop], k)
        hidden = key_pos.view(r, h, 1, n) > query_pos[:, start:stop].view(r, 1, stop - start, 1)  # [R, H, W', N]
        # Hidden keys get a finite -1e30 (exp gives exactly 0 beside any visible key; written over whatever
        # padding holds), so a query that sees none has a finite, uniform row; its weight 0 drops it.
        logits.masked_fill_(hidden.unsqueeze(2), _HIDDEN)
        probs = torch.softmax(logits, dim=-1)
        sees = (query_pos[:, start:stop].view(r, 1, stop - start) >= first_seen).to(torch.float32)
        out += torch.matmul(sees.view(r, h, 1, 1, stop - start), probs).squeeze(3)
    return out if per_query_head else out.sum(dim=2)


def row_gains(gain: Tensor | float | None, rows: int, width: int, device: torch.device) -> Tensor:
    """The logit gain of every window entry, fp32 [R, W], from None (1), a number, [R] or [R, W]."""
    if gain is None:
        return torch.ones(rows, width, device=device)
    if not isinstance(gain, Tensor):
        return torch.full((rows, width), float(gain), device=device)
    g = gain.to(device=device, dtype=torch.float32)
    if g.dim() == 0:
        return g.expand(rows, width)
    if g.dim() == 1:
        return g.view(rows, 1).expand(rows, width)
    return g


def latest_queries(query_positions: Tensor, seq_len: Tensor, count: Tensor | int) -> Tensor:
    """``query_positions`` with every query but the last ``count`` of each row emptied ([R, W]).

    The window holds queries in any order (a ring buffer); the last ``count`` are those at logical
    positions >= seq_len - count."""
    threshold = seq_len.view(-1, 1) - (count.view(-1, 1) if isinstance(count, Tensor) else count)
    return torch.where(query_positions >= threshold, query_positions,
                       torch.full_like(query_positions, EMPTY_QUERY))


# ---- KeyDiff ---------------------------------------------------------------------------------------
def normalised_keys(keys: Tensor) -> Tensor:
    """k̂ = k / max(‖k‖, eps) in fp32, same shape as ``keys``."""
    k = keys.float()
    return k / k.norm(dim=-1, keepdim=True).clamp_min(KEY_NORM_EPS)


def keydiff_scores(keys: Tensor, lengths: Tensor) -> Tensor:
    """−k̂_jᵀμ with μ the mean of k̂ over a row's candidates: fp32 [R, H, N], -inf on padding.

    Dividing by ‖μ‖ would give the exact −cos(k_j, μ); it is a positive per-head constant that cannot
    change the ranking and is ill-conditioned when ‖μ‖ ≈ 0, so it is left out."""
    n = keys.shape[2]
    valid = valid_slots(lengths, n)  # [R, 1, N]
    khat = normalised_keys(keys).masked_fill(~valid.unsqueeze(-1), 0.0)  # padding may hold anything
    anchor = khat.sum(dim=2, keepdim=True) / lengths.clamp_min(1).view(-1, 1, 1, 1).float()
    scores = -(khat * anchor).sum(dim=-1)
    return scores.masked_fill(~valid, float("-inf"))


# ---- CAOTE -----------------------------------------------------------------------------------------
def normalise_mass(mass: Tensor, valid: Tensor) -> Tensor:
    """α = h / Σh over each row's candidates (last axis); uniform where the mass sums to zero; 0 on padding."""
    h = mass.float().clamp_min(0.0).masked_fill(~valid, 0.0)  # rounding can leave a tiny negative; a mass is >= 0
    total = h.sum(dim=-1, keepdim=True)
    count = valid.sum(dim=-1, keepdim=True).clamp_min(1)
    uniform = valid / count
    return torch.where(total > 0, h / torch.where(total > 0, total, torch.ones_like(total)), uniform)


def output_error_from_center(alpha: Tensor, values: Tensor, center: Tensor, eps: float) -> Tensor:
    """α/(1−α)·‖X − v_j‖₂ with +inf where 1 − α < eps.

    alpha [R, H, *, N]; values [R, H, N, d]; center [R, H, *, d] (``*``: nothing, or G query heads)."""
    extra = alpha.dim() - 3
    v = values.float().view(*values.shape[:2], *([1] * extra), *values.shape[2:])
    dist = torch.linalg.vector_norm(center.unsqueeze(-2) - v, dim=-1)  # direct difference, no expansion
    one_minus = 1.0 - alpha
    err = alpha / one_minus.clamp_min(eps) * dist
    return torch.where(one_minus < eps, torch.full_like(err, float("inf")), err)


def floor_output_error(err: Tensor, alpha: Tensor, eps: Tensor) -> Tensor:
    """CAOTE errors computed with a floor at most every row's ``eps`` ([R, 1, 1]), brought to each row's
    own: +inf where 1 - alpha < eps; elsewhere max(1 - alpha, floor) = 1 - alpha already. Exactly
    ``output_error`` with the row's own floor."""
    return torch.where(1.0 - alpha < eps, torch.full_like(err, float("inf")), err)


def output_error(alpha: Tensor, values: Tensor, lengths: Tensor, fast: bool = False, eps: float = 1e-6) -> Tensor:
    """CAOTE's score of every candidate from normalised base weights ``alpha`` [R, H, N] (0 on padding):
    X = Σ_j α_j v_j (``fast``: the plain mean of the row's values). fp32 [R, H, N], -inf on padding."""
    n = values.shape[2]
    valid = valid_slots(lengths, n)
    v = values.float().masked_fill(~valid.unsqueeze(-1), 0.0)
    if fast:
        center = v.sum(dim=2) / lengths.clamp_min(1).view(-1, 1, 1).float()
    else:
        center = torch.einsum("rhn,rhnd->rhd", alpha.float(), v)
    return output_error_from_center(alpha.float(), v, center, eps).masked_fill(~valid, float("-inf"))


# ---- CriticalKV ------------------------------------------------------------------------------------
def value_norms(values: Tensor, o_proj: Tensor) -> Tensor:
    """ν [H, T]: group mean over query heads h of ‖v W_O^(h)‖₁, per token (fp32).

    values [H, T, d]; o_proj [hidden, H_q*d] as ``nn.Linear(H_q*d, hidden).weight``: column h*d + e is
    entry e of query head h, and query head h serves KV head h // G. Tokens go through in blocks so
    the projected values of a long prefill chunk never exist at once."""
    h, t, d = values.shape
    if o_proj.dim() != 2 or o_proj.shape[1] % d != 0 or (o_proj.shape[1] // d) % h != 0:
        raise ValueError(f"o_proj must be [hidden, H_q*{d}] with H_q a multiple of {h} KV heads, "
                         f"got shape {tuple(o_proj.shape)}")
    group = o_proj.shape[1] // d // h
    hidden = o_proj.shape[0]
    weight = o_proj.to(device=values.device, dtype=torch.float32).view(hidden, h, group, d)
    v = values.float()
    out = torch.empty(h, t, dtype=torch.float32, device=values.device)
    block = max(1, _VALUE_NORM_BLOCK // max(1, h * group * hidden))
    for start in range(0, t, block):
        stop = min(start + block, t)
        projected = torch.einsum("htd,ohgd->hgto", v[:, start:stop], weight)
        out[:, start:stop] = projected.abs().sum(dim=-1).mean(dim=1)
    return out


# ---- masks, pooling, selection ---------------------------------------------------------------------
def recent_mask(positions: Tensor, valid: Tensor, count: Tensor | int) -> Tensor:
    """Bool [R, H, N]: candidates within the last ``count`` logical positions of their row (per row: an
    int or [R]): position > newest - count."""
    newest = positions.masked_fill(~valid, -1).amax(dim=-1, keepdim=True)
    threshold = newest - (count.view(-1, 1, 1) if isinstance(count, Tensor) else count)
    return valid & (positions > threshold)


def sink_mask(positions: Tensor, valid: Tensor, count: Tensor | int) -> Tensor:
    """Bool [R, H, N]: candidates among the first ``count`` logical positions (per row: an int or [R])."""
    return valid & (positions < (count.view(-1, 1, 1) if isinstance(count, Tensor) else count))


def order_by_position(positions: Tensor, valid: Tensor) -> Tensor:
    """Per (row, head) permutation sorting the candidates by logical position, padding last."""
    key = positions.long().masked_fill(~valid, torch.iinfo(torch.int64).max)
    return torch.argsort(key, dim=-1, stable=True)


def _in_position_order(scores: Tensor, order: Tensor, fn) -> Tensor:
    idx = order.view(*order.shape[:2], *([1] * (scores.dim() - 3)), order.shape[-1]).expand_as(scores)
    ordered = torch.gather(scores, -1, idx)
    return torch.empty_like(ordered).scatter_(-1, idx, fn(ordered))


def _pool_1d(x: Tensor, kernel: Tensor | int, kernel_max: int, kind: str) -> Tensor:
    """Stride-1 'same' pooling along the last axis, kernel ``kernel`` (odd; per row of the first axis:
    an int or [R]), zero padding (``avg``, dividing by the full kernel) or -inf padding (``max``).

    With one kernel for every row this is torch's pooling. With a kernel per row the window is summed
    over the widest kernel in order, the offsets outside a row's own kernel adding exact zeros: the
    same sum in the same order as torch's pooling of that row alone, so a row's result does not depend
    on the kernels of the rows batched with it."""
    if not isinstance(kernel, Tensor):
        flat = x.reshape(-1, 1, x.shape[-1])
        pool = F.avg_pool1d if kind == "avg" else F.max_pool1d
        return pool(flat, kernel, stride=1, padding=kernel // 2).reshape(x.shape)
    half_max, n = kernel_max // 2, x.shape[-1]
    half = (kernel // 2).view(-1, *([1] * (x.dim() - 1)))
    filler = 0.0 if kind == "avg" else float("-inf")
    padded = F.pad(x, (half_max, half_max), value=filler)
    out = None
    for offset in range(-half_max, half_max + 1):
        term = padded[..., half_max + offset:half_max + offset + n]
        term = torch.where(half >= abs(offset), term, torch.full_like(term, filler))
        out = term if out is None else (out + term if kind == "avg" else torch.maximum(out, term))
    return out / kernel.view(-1, *([1] * (x.dim() - 1))).to(x.dtype) if kind == "avg" else out


def pool_in_position_order(scores: Tensor, positions: Tensor, valid: Tensor, kernel: Tensor | int, kind: str,
                           kernel_max: int | None = None) -> Tensor:
    """Smooth scores [R, H, *, N] along each row's logical token order, stride 1, 'same' size.

    ``avg`` divides by the full kernel (zero padding at both ends of the row), ``max`` takes the max
    of the in-row neighbours, ``none`` returns the scores unchanged. ``kernel`` per row: an int, or an
    [R] tensor with ``kernel_max`` its largest value (on the host)."""
    widest = kernel if not isinstance(kernel, Tensor) else kernel_max
    if kind == "none" or widest <= 1:
        return scores
    if kind not in ("avg", "max"):
        raise ValueError(f"unknown pooling {kind!r}; choose avg, max or none")
    mask = valid.view(valid.shape[0], 1, *([1] * (scores.dim() - 3)), valid.shape[-1])
    filler = 0.0 if kind == "avg" else float("-inf")  # what the row's own edge padding would hold
    masked = scores.masked_fill(~mask, filler)
    return _in_position_order(masked, order_by_position(positions, valid),
                              lambda x: _pool_1d(x, kernel, widest, kind))


def mean_pool_in_position_order(values: Tensor, positions: Tensor, valid: Tensor, kernel: Tensor | int,
                                kernel_max: int | None = None) -> Tensor:
    """Average of each candidate's in-row neighbours along the logical order, counting only the
    candidates that exist (``count_include_pad=False``): [R, H, N], 0 on padding. ``kernel`` per row as
    ``pool_in_position_order`` takes it."""
    order = order_by_position(positions, valid)
    weight = valid.expand_as(values).float()
    widest = kernel if not isinstance(kernel, Tensor) else kernel_max

    def window_sum(x: Tensor) -> Tensor:
        return _pool_1d(x, kernel, widest, "avg")

    total = _in_position_order(values.float().masked_fill(~valid, 0.0), order, window_sum)
    count = _in_position_order(weight, order, window_sum)
    return torch.where(valid, total / count.clamp_min(1e-30), torch.zeros_like(total))


def protect(scores: Tensor, mask: Tensor) -> Tensor:
    """Give protected tokens +inf so every top-k keeps them."""
    return scores.masked_fill(mask, float("inf"))


def rank_descending(scores: Tensor) -> Tensor:
    """Rank of every slot under a stable descending sort of ``scores`` along the last axis (0 = best)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def topk_keep(scores: Tensor, valid: Tensor, budget: Tensor, budget_max: int) -> Tensor:
    """Kept slots [R, H, budget_max], int64: row r keeps its ``budget[r]`` highest scores per head, in
    ascending slot order in the first ``budget[r]`` columns; the remaining columns hold the row's
    padding width N (no slot). Ties go to the lower slot; NaN ranks lowest; padding is never kept."""
    n = scores.shape[-1]
    s = torch.nan_to_num(scores.float(), nan=float("-inf")).masked_fill(~valid, float("-inf"))
    # A stable sort puts padding (at the end of the row) after real -inf scores.
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :budget_max]
    taken = torch.arange(budget_max, device=scores.device).view(1, 1, -1) < budget.view(-1, 1, 1)
    return torch.sort(torch.where(taken, order, torch.full_like(order, n)), dim=-1).values


# ---- counter-based random numbers ------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in int64 without overflow (two 16-bit halves)."""
    low = (x & 0xFFFF) * c
    high = ((x >> 16) * c) & 0xFFFF
    return (low + (high << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit avalanche mixer (xor-shift-multiply)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_hash(*keys: Tensor | int) -> Tensor:
    """Uniform draws in (0, 1), fp32, one per element of the broadcast of ``keys`` (non-negative ints).

    Counter-based: the draw is a hash of the keys, so it is the same on every device, for any batch
    composition and any slot order, with no generator state."""
    shape = torch.broadcast_shapes(*(k.shape if isinstance(k, Tensor) else () for k in keys))
    device = next((k.device for k in keys if isinstance(k, Tensor)), torch.device("cpu"))
    h = torch.zeros(shape, dtype=torch.int64, device=device)
    for key in keys:
        # A Python int stays a scalar operand (a device tensor made from it would be a blocking copy).
        key = key.to(device=device, dtype=torch.int64) if isinstance(key, Tensor) else int(key)
        for part in (key & _M32, (key >> 32) & _M32):  # 64-bit keys: both halves
            h = _mix32(h ^ part)
    # The top 23 bits: k + 0.5 then needs 24 significant bits, exact in fp32, so every draw is < 1. (With
    # 24 bits the largest draw, 1 - 2^-25, rounded to 1.0 in fp32: a Gumbel draw of +inf.)
    return (((h >> 9).double() + 0.5) / float(1 << 23)).float()
