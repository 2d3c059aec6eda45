"""PyTorch reference for reading and compacting one request's tokens in a paged KV cache.

Conventions shared with the kernels (kernels/) and the engine:
- ``k_cache`` and ``v_cache`` are views of one layer's cache shaped [num_blocks, H_kv, block_size, d];
  they may be strided (the CPU backend stores K tiles transposed, GPU backends interleave heads),
  which is why everything here indexes through the view instead of assuming contiguity.
- a per-token state buffer is [num_blocks, H_kv, block_size] (fp32 or int).
- ``block_ids`` is the request's page list in logical order (int64, 1-D); slot s lives in page
  ``block_ids[s // block_size]`` at offset ``s % block_size``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def slot_index(block_ids: Tensor, length: int, block_size: int) -> tuple[Tensor, Tensor]:
    """(page, offset) of slots 0..length-1."""
    slots = torch.arange(length, device=block_ids.device)
    return block_ids[slots // block_size], slots % block_size


def gather_tokens(cache: Tensor, block_ids: Tensor, length: int) -> Tensor:
    """[num_blocks, H, bs, *rest] -> [H, length, *rest]: the request's first ``length`` slots per head."""
    pages, offsets = slot_index(block_ids, length, cache.shape[2])
    return cache[pages, :, offsets].transpose(0, 1)


def scatter_tokens(cache: Tensor, block_ids: Tensor, values: Tensor) -> None:
    """Write values [H, length, *rest] into the request's first ``length`` slots (in place)."""
    pages, offsets = slot_index(block_ids, values.shape[1], cache.shape[2])
    cache[pages, :, offsets] = values.transpose(0, 1).to(cache.dtype)


def write_tokens(cache: Tensor, block_ids: Tensor, start: int, values: Tensor) -> None:
    """Write values [H, m, *rest] into slots start..start+m-1 of the request (in place)."""
    slots = torch.arange(start, start + values.shape[1], device=block_ids.device)
    block_size = cache.shape[2]
    cache[block_ids[slots // block_size], :, slots % block_size] = values.transpose(0, 1).to(cache.dtype)


def compact_tokens(caches: list[Tensor], block_ids: Tensor, keep: Tensor) -> None:
    """Move each head's kept slots ``keep`` [H, b] (ascending) into its first b slots, in place.

    Every tensor in ``caches`` (K view, V view, per-token state buffers) is moved the same way. The
    kept tokens are gathered into a dense copy before anything is written, so no slot is read after
    it has been overwritten.
    """
    if keep.numel() == 0:
        return
    h, budget = keep.shape
    used = int(keep.max().item()) + 1
    for cache in caches:
        dense = gather_tokens(cache, block_ids, used)  # [H, used, *rest]
        index = keep.to(dense.device).view(h, budget, *([1] * (dense.dim() - 2))).expand(h, budget, *dense.shape[2:])
        scatter_tokens(cache, block_ids, torch.gather(dense, 1, index))


def permute_tokens(caches: list[Tensor], block_ids: Tensor, order: Tensor) -> None:
    """Reorder each head's first n slots by ``order`` [H, n] (a permutation per head); test hook."""
    h, n = order.shape
    for cache in caches:
        dense = gather_tokens(cache, block_ids, n)
        index = order.view(h, n, *([1] * (dense.dim() - 2))).expand_as(dense)
        scatter_tokens(cache, block_ids, torch.gather(dense, 1, index))


# ---- batched paged references of the score operations ------------------------------------------
# Shared conventions (see also vllm_evict/ops.py and kernels/):
# - ``block_table`` [R, max_pages] (int32/int64): row r is request r's page list in logical order;
# - ``lengths`` [R]: physical length (slots in use) of each request;
# - ``positions`` (optional) [num_blocks, H_kv, block_size] int: logical position of every slot, per
#   head (slots of different heads hold different tokens once compaction has run). ``None`` means
#   "slot index = position" (true until the first compaction);
# - window queries are packed as vLLM packs them: ``queries`` [T, H_q, d], request r owning rows
#   ``query_start_loc[r]:query_start_loc[r+1]`` (oldest first) with logical ``query_positions`` [T];
# - outputs are padded to [R, H_kv, max_len]; mass outputs hold 0 and score outputs -inf beyond a
#   request's length.
# Every reference gathers one request at a time and calls the policy library's own math, so the
# kernels are tested against exactly what the policies compute.


def _max_len(lengths: Tensor, max_len: int | None) -> int:
    return int(lengths.max().item()) if max_len is None and lengths.numel() else int(max_len or 0)


def _request_positions(positions: Tensor | None, block_ids: Tensor, length: int, h_kv: int,
                       device: torch.device) -> Tensor:
    if positions is None:
        return torch.arange(length, device=device).expand(h_kv, length)
    return gather_tokens(positions, block_ids, length).long()


def compact_tokens_batched(caches: list[Tensor], block_table: Tensor, keep: Tensor,
                           counts: Tensor | None = None) -> None:
    """``compact_tokens`` for several requests: keep [R, H, b_max] (ascending per head in the first
    ``counts[r]`` columns; ``counts`` None means all b_max)."""
    for r in range(keep.shape[0]):
        b = keep.shape[2] if counts is None else int(counts[r])
        if b > 0:
            compact_tokens(caches, block_table[r].long(), keep[r, :, :b])


def paged_window_attention_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                                query_start_loc: Tensor, query_positions: Tensor, scale: float,
                                positions: Tensor | None = None, gain: Tensor | None = None,
                                reduce_group: bool = True, max_len: int | None = None) -> Tensor:
    """Observation-window attention mass over paged keys.

    For every request: softmax over all its cached keys of each window query (gain * scale * q.k,
    causal by logical position), summed over the window. Returns fp32 [R, H_kv, max_len] summed over
    the G query heads of each KV head (``reduce_group``) or [R, H_kv, G, max_len].
    ``gain`` is None or [T] (one per packed query row; AhaKV's SG-softmax gain).
    """
    from vllm_evict.policies.attention import attention_column_sums

    n_req = lengths.shape[0]
    h_kv = k_cache.shape[1]
    group = queries.shape[1] // h_kv
    width = _max_len(lengths, max_len)
    out = torch.zeros(n_req, h_kv, group, width, dtype=torch.float32, device=k_cache.device)
    for r in range(n_req):
        length = int(lengths[r])
        q0, q1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        if length == 0 or q1 == q0:
            continue
        ids = block_table[r].long()
        keys = gather_tokens(k_cache, ids, length)
        pos = _request_positions(positions, ids, length, h_kv, k_cache.device)
        g = 1.0 if gain is None else gain[q0:q1].float()
        out[r, :, :, :length] = attention_column_sums(
            keys, pos, queries[q0:q1].transpose(0, 1), query_positions[q0:q1].long(), scale, gain=g)
    return out.sum(dim=2) if reduce_group else out


def paged_keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor,
                         max_len: int | None = None) -> Tensor:
    """KeyDiff's −k̂ᵀμ (policies/keydiff.py) per request: fp32 [R, H_kv, max_len], -inf padding."""
    from vllm_evict.policies.keydiff import keydiff_scores

    width = _max_len(lengths, max_len)
    out = torch.full((lengths.shape[0], k_cache.shape[1], width), float("-inf"), device=k_cache.device)
    for r in range(lengths.shape[0]):
        length = int(lengths[r])
        if length:
            out[r, :, :length] = keydiff_scores(gather_tokens(k_cache, block_table[r].long(), length))
    return out


def paged_caote_scores(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor,
                       fast: bool = False, eps: float = 1e-6) -> Tensor:
    """CAOTE / FastCAOTE value term (policies/caote.py, group mode) per request.

    ``alpha`` [R, H_kv, >= max_len]: the normalised base scores (``caote.normalise_mass``) of each
    request's slots. X = Σ_j α_j v_j (or the plain mean of v when ``fast``), then
    c_j = α_j/(1−α_j)·||X − v_j||₂ with +inf where 1 − α_j < eps. fp32 [R, H_kv, width], -inf padding.
    """
    from vllm_evict.policies.caote import output_error

    width = alpha.shape[2]
    out = torch.full((lengths.shape[0], v_cache.shape[1], width), float("-inf"), device=v_cache.device)
    for r in range(lengths.shape[0]):
        length = int(lengths[r])
        if length == 0:
            continue
        v = gather_tokens(v_cache, block_table[r].long(), length).float()
        a = alpha[r, :, :length].float()
        center = v.mean(dim=1) if fast else torch.einsum("hn,hnd->hd", a, v)
        out[r, :, :length] = output_error(a, v, center, eps)
    return out


def paged_criticalkv_value_norms(v_cache: Tensor, block_table: Tensor, starts: Tensor, ends: Tensor,
                                 o_proj: Tensor, out: Tensor) -> Tensor:
    """CriticalKV's ν (policies/criticalkv.py ``projected_value_l1``) for slots ``starts[r]:ends[r]``
    of every request, written into the paged state buffer ``out`` [num_blocks, H_kv, block_size]."""
    from vllm_evict.policies.criticalkv import projected_value_l1

    bs = out.shape[2]
    for r in range(starts.shape[0]):
        s0, s1 = int(starts[r]), int(ends[r])
        if s1 <= s0:
            continue
        ids = block_table[r].long()
        values = gather_tokens(v_cache, ids, s1)[:, s0:]
        nu = projected_value_l1(values, o_proj)
        slots = torch.arange(s0, s1, device=out.device)
        out[ids[slots // bs], :, slots % bs] = nu.transpose(0, 1).to(out.dtype)
    return out
