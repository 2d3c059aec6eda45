"""The per-step state writes of a group of rows (the window mass as it accumulates, a policy's updated
state, the window reset) cover the group's whole padded [R, N] slot grid; a shorter row's slots past its
length must land in vLLM's null page, never in a page another request holds.

Why they could: a row's block-table entries past its own pages are not cleared by every runner. Model
Runner V2 keeps a request's slot row past ``num_blocks`` as the row's last occupant left it, or as the row
itself left it before a compaction shortened it; the scheduler has since given those pages to other
requests. The V1 runner clears them. The real engine runs a batch whose decoding rows straddle a page
boundary in one group (budget 60, slack 8: 61 to 68 tokens, over pages of 32) while requests compact,
finish and are replaced; every group of every step is checked against the pages the scheduler has given
each request (the suite's V2 pass runs it on V2, where the stale entries are there to be written)."""

from __future__ import annotations

import pytest

from tests.engine.helpers import BLOCK, TEST_RUNNER, greedy, token_prompt
from vllm_evict.engine import runner as runner_module
from vllm_evict.paged import TRASH_PAGE

pytestmark = pytest.mark.engine

SERVER = {"policy": "snapkv", "budget": 60, "window": 8, "schedule": "chunked", "slack": 8}


def test_padding_slots_never_write_into_another_requests_pages(tiny_llama, engine_factory, monkeypatch):
    # Decode windows accumulated (not kept in lent pages): every decode step of the batch is a group.
    monkeypatch.setenv("VLLM_EVICT_WINDOW_PAGES", "0")
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=4, max_num_batched_tokens=96, pages=64,
                            max_model_len=512)
    held = engine.scheduler.attention_manager.req_to_blocks
    padding, exposed, stray = [0], [0], []
    evict_layer = runner_module.evict_layer

    def checking(cache, plan, step_query):
        if cache.index == 0:
            owners = {page: rid for rid, blocks in held.items() for page in (b.block_id for b in blocks)}
            for group in plan.groups:
                table, pages = group.block_table.tolist(), group.slot_pages.tolist()
                for row, length in enumerate(group.lengths.tolist()):
                    own = set(table[row][:-(-length // BLOCK)])
                    # The precondition: table entries past the row's pages that others hold now.
                    exposed[0] += sum(page in owners and page not in own for page in table[row][len(own):])
                    for slot in range(length, group.width):  # the row's padding, written with the grid
                        padding[0] += 1
                        page = pages[row][slot]
                        if page != TRASH_PAGE and page not in own and page in owners:
                            stray.append((row, slot, page, owners[page]))
        return evict_layer(cache, plan, step_query)

    runner_module.evict_layer = checking
    try:
        # Requests of different lengths finish at different steps and new ones take their rows (V2: their
        # slots); every fourth one keeps its whole cache, so the rows it leaves are long.
        lengths = [150 + 37 * (i % 5) for i in range(8)]
        tokens = [8 + 5 * (i % 4) for i in range(8)]
        params = [greedy(t, **({"kv_eviction": "none"} if i % 4 == 0 else {})) for i, t in enumerate(tokens)]
        outputs = engine.llm.generate([token_prompt(n, offset=i + 1) for i, n in enumerate(lengths)], params,
                                      use_tqdm=False)
    finally:
        runner_module.evict_layer = evict_layer
    assert [len(o.outputs[0].token_ids) for o in outputs] == tokens
    assert padding[0] > 150, f"only {padding[0]} padding slots were written: the batch tests nothing"
    assert not stray, f"{len(stray)} padding writes into other requests' pages, e.g. {stray[:5]}"
    if TEST_RUNNER == "v2":  # V2 leaves them in the table (the V1 runner clears a row past its pages)
        assert exposed[0] > 0, "no row's table named another request's page: the batch tests nothing on V2"
