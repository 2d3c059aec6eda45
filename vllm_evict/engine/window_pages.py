"""Window pages: a decode window's queries kept in pages lent from vLLM's own KV pool.

A fixed-mode request ranks its tokens by the attention mass of an observation window of recent queries
(SnapKV, TOVA, NaCl and the meta scores over them). While decoding, a window spans several steps, and
the mass of each query must be computed against the cache as it stands when the window is read. Two
ways to get it, the same tokens either way:

* accumulate: each window query adds its softmax row to the per-token state ``wmass`` when it is
  computed (an attention-sized pass per layer on every step inside a window; no memory);
* window pages (this module): the window's queries are written into KV pages the scheduler lends the
  request for as long as it is inside a decode window (a gather and a scatter per layer and step), and the
  window's mass is computed once, from them, in the step that reads the window.

The scheduler lends pages only from what the pool has free (engine/window_lender.py), and takes them
back before any allocation would fail, so they never cost a preemption or a later admission; a
request without pages accumulates.

Layout. A lent page is a KV page like any other: per layer, per KV head, ``page_size`` slots of K and
``page_size`` slots of V, ``head_size`` values each, which is exactly one query head's vector. A query
of KV head h's group has G query heads (G = H_q / H_kv), so it takes G slots of KV head h: entry ``e``
of the window (the query at logical position p sits in entry ``p % capacity``) and member ``g`` of the
group take slot ``s = e * G + g`` of the request's lent space, which runs over page 0's K slots, page
0's V slots, page 1's K slots, and so on. The engine reads and writes them through the same
[num_pages, H_kv, page_size, head_size] views it compacts K and V with, so any KV layout works.

Rows. Where every slot of those views is (or, for K stored transposed as a [head_size, page_size] tile,
where the tile's memory can be cut into) ``page_size`` runs of ``head_size`` contiguous elements, the
window slots are rows of one [rows, head_size] view of the layer's KV storage (``slot_row_view``), at the
same row numbers in every layer (``SlotRows``). The host then computes a step's rows once, and a layer
writes its window queries with one ``index_copy_`` and reads them with one ``index_select``, instead of
advanced indexing through the K and V views (two gathers and two scatters per layer and step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vllm_evict.dense import EMPTY_QUERY

NO_PAGE = -1


def pages_for_window(width: int, group: int, page_size: int) -> int:
    """Pages that hold a window of ``width`` queries of ``group`` query heads per KV head."""
    return -(-width * group // (2 * page_size))


def capacity(pages: np.ndarray, group: int, page_size: int) -> np.ndarray:
    """Window entries ``pages`` lent pages hold (per row; 0 without pages)."""
    return pages * 2 * page_size // group


@dataclass(frozen=True)
class Slots:
    """Addresses of window slots, on the host: ``page`` and ``offset`` in the KV views, and whether the
    slot is in the page's V half (``in_v``) or its K half. Same shape as the slots asked for."""

    page: np.ndarray
    offset: np.ndarray
    in_v: np.ndarray


def slot_addresses(lent: np.ndarray, entries: np.ndarray, group: int, page_size: int) -> Slots:
    """Addresses of every group member's slot for window ``entries``.

    lent: [R, P] each row's lent pages (NO_PAGE padding); entries: [R, M] window entries (any value
    where unused: the address is then some slot of the row's first page). Returns [R, M, G] arrays."""
    member = np.arange(group)
    slot = entries[:, :, None] * group + member  # [R, M, G]
    chunk = slot // page_size
    page = np.take_along_axis(lent, (chunk // 2).reshape(len(lent), -1).clip(0, lent.shape[1] - 1), axis=1)
    return Slots(page=page.reshape(slot.shape), offset=slot % page_size, in_v=(chunk % 2).astype(bool))


def window_entries(seq_len: np.ndarray, count: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries and logical positions of each row's latest ``count`` queries (the window's queries
    waiting in its pages) before logical length ``seq_len``: ([R, M], [R, M]) with M = max(count), the
    positions EMPTY_QUERY on padding."""
    width = int(count.max()) if count.size else 0
    column = np.arange(width)
    present = column[None, :] < count[:, None]
    positions = seq_len[:, None] - count[:, None] + column[None, :]
    entries = np.where(present, positions % np.maximum(cap, 1)[:, None], 0)
    return entries, np.where(present, positions, EMPTY_QUERY)


def write_table(lent: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cap: np.ndarray, group: int,
                page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Where queries go: for each query (its token in the step's packed axis, its logical position, its
    row's lent pages [n, P] and capacity [n]), int64 [4, m] columns (token, group member, page, offset)
    for the slots in K halves, and the same for V halves."""
    addr = slot_addresses(lent, (positions % np.maximum(cap, 1))[:, None], group, page_size)
    table = np.stack([np.repeat(tokens, group), np.tile(np.arange(group), len(tokens)),
                      addr.page.reshape(-1), addr.offset.reshape(-1)]).astype(np.int64)
    in_v = addr.in_v.reshape(-1)
    return table[:, ~in_v], table[:, in_v]


@dataclass(frozen=True)
class SlotRows:
    """Window slots as rows of ``slot_row_view``: slot (page, half, KV head, offset) is row
    ``half_base[half] + page * page_rows + head * head_rows + offset * slot_rows`` (half 0: K, 1: V)."""

    heads: int
    page_rows: int
    head_rows: int
    slot_rows: int
    half_base: tuple[int, int]

    def rows(self, slots: Slots) -> np.ndarray:
        """The rows of ``slots`` for every KV head: int64 [*slots.page.shape, H_kv]. A page below 0
        (a row with no loan; its entries are padding) reads the null page."""
        base = np.where(slots.in_v, self.half_base[1], self.half_base[0])
        first = base + np.maximum(slots.page, 0) * self.page_rows + slots.offset * self.slot_rows
        return (first[..., None] + np.arange(self.heads) * self.head_rows).astype(np.int64)


def _tile_rows(view: Tensor, head_size: int) -> tuple[int, int, int] | None:
    """(page, head, slot) strides of a [num_pages, H_kv, page_size, head_size] view in rows of
    ``head_size`` elements, or None where its slots cannot be rows."""
    if not isinstance(view, Tensor) or view.dim() != 4:
        return None
    s_page, s_head, s_slot, s_dim = view.stride()
    if s_dim == 1 and s_slot % head_size == 0:
        slot = s_slot // head_size
    elif s_slot == 1 and s_dim == view.shape[2]:  # a transposed tile: its memory holds page_size rows
        slot = 1
    else:
        return None
    if s_page % head_size or s_head % head_size:
        return None
    return s_page // head_size, s_head // head_size, slot


def slot_row_view(k: Tensor, v: Tensor) -> tuple[SlotRows, Tensor] | None:
    """One layer's window slots as rows: their numbers, and the [rows, head_size] view of the storage K
    and V share; None where the layout has no such rows (packed tiles, K and V apart)."""
    if not (isinstance(k, Tensor) and isinstance(v, Tensor)) or k.dtype != v.dtype:
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    head_size = k.shape[3]
    strides = _tile_rows(k, head_size)
    if strides is None or strides != _tile_rows(v, head_size):
        return None
    origin = min(k.storage_offset(), v.storage_offset())
    if (k.storage_offset() - origin) % head_size or (v.storage_offset() - origin) % head_size:
        return None
    end = max(t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 for t in (k, v))
    count = -(-(end - origin) // head_size)
    if (origin + count * head_size) * k.element_size() > k.untyped_storage().nbytes():
        return None
    rows = SlotRows(heads=k.shape[1], page_rows=strides[0], head_rows=strides[1], slot_rows=strides[2],
                    half_base=((k.storage_offset() - origin) // head_size, (v.storage_offset() - origin) // head_size))
    return rows, torch.as_strided(k, (count, head_size), (head_size, 1), origin)


def write_rows(lent: np.ndarray, tokens: np.ndarray, positions: np.ndarray, cap: np.ndarray, group: int,
               page_size: int, rows: SlotRows) -> np.ndarray:
    """``write_table`` as rows: int64 [3, m * H_kv] columns (row, token in the step, query head), one per
    slot and KV head."""
    addr = slot_addresses(lent, (positions % np.maximum(cap, 1))[:, None], group, page_size)
    target = rows.rows(addr)  # [n, 1, G, H_kv]
    member = np.arange(group)[None, None, :, None]
    head = member + group * np.arange(rows.heads)[None, None, None, :]  # query head h * G + g
    token = np.broadcast_to(tokens[:, None, None, None], target.shape)
    return np.stack([target.reshape(-1), token.reshape(-1), np.broadcast_to(head, target.shape).reshape(-1)])
