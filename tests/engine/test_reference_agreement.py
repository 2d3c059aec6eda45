"""The engine must evict exactly what the HF reference runner evicts: same kept logical positions per
layer and KV head, same greedy tokens, for each schedule (real SmolLM2 weights, fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.helpers import BLOCK, TEST_RUNNER, engine_kept_positions, greedy
from vllm_evict import EvictionConfig
from vllm_evict.policies.base import Phase
from vllm_evict.reference import run_reference

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CHUNK = 64
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made across Europe. Before that, scribes copied every page by hand, which made books "
          "rare and expensive. ") * 6


# On Model Runner V2 (the suite's V2 pass) the policies run the same eviction step as on V1; what V2
# changes is how the step's lengths, positions, slots and pages reach it. A chunked method, a one-shot
# method with an observation window and a method whose state changes every step cover those paths;
# tests/engine/test_mixed_batch.py runs more methods against the reference there, in one batch.
V2_SUBSET = {("keydiff", "chunked"), ("h2o", "chunked"), ("snapkv", "oneshot")}


@pytest.mark.parametrize("spec,schedule", [("keydiff", "chunked"), ("h2o", "chunked"), ("snapkv", "oneshot"),
                                           ("caote+snapkv", "chunked"), ("criticalkv+snapkv", "oneshot"),
                                           ("tova", "chunked"),
                                           ("ahakv", "oneshot"), ("nacl", "oneshot")])
def test_engine_keeps_what_the_reference_keeps(smollm2_path, engine_factory, spec, schedule):
    if TEST_RUNNER == "v2" and (spec, schedule) not in V2_SUBSET:
        pytest.skip("the V2 pass runs one chunked, one one-shot and one every-step method (V2_SUBSET)")
    agrees_with_reference(smollm2_path, engine_factory, {"policy": spec, "budget": 96, "schedule": schedule},
                          new_tokens=12)


# Decode windows: 40 new tokens at budget 96 and a slack of 16 (< SnapKV's window of 32) evict twice while
# decoding, each reading the 16 queries since the previous eviction. By default the scheduler lends each
# request free pages of the KV pool for its decode window's queries and the window's mass is computed from
# them when it is read (engine/window_pages.py); with lending off (VLLM_EVICT_WINDOW_PAGES=0) it is
# accumulated query by query, as the reference does. Both keep the reference's tokens.
@pytest.mark.parametrize("spec,schedule,lend", [("snapkv", "oneshot", True), ("caote+snapkv", "chunked", True),
                                                ("nacl", "oneshot", True), ("snapkv", "oneshot", False)])
def test_decode_windows_keep_what_the_reference_keeps(smollm2_path, engine_factory, monkeypatch, spec, schedule,
                                                      lend):
    if TEST_RUNNER == "v2" and spec != "caote+snapkv":
        pytest.skip("the V2 pass runs one method with lent window pages")
    if not lend:
        monkeypatch.setenv("VLLM_EVICT_WINDOW_PAGES", "0")
    engine = agrees_with_reference(smollm2_path, engine_factory, {"policy": spec, "budget": 96, "schedule": schedule,
                                                                  "slack": 16}, new_tokens=40)
    lender = engine.scheduler.window_pages
    assert (lender.loans > 0) == lend and not lender.lent  # every loan came back with the request
    assert engine.free_pages() == engine.total_pages()


def agrees_with_reference(smollm2_path, engine_factory, eviction: dict, new_tokens: int) -> Any:
    engine = engine_factory(str(smollm2_path), eviction, max_num_batched_tokens=CHUNK,
                            pages=0, kv_cache_memory_bytes=160 << 20)
    tokenizer = engine.llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT)["input_ids"][:300]
    output, engine_kept = engine_kept_positions(engine, prompt_ids, greedy(new_tokens))

    config = EvictionConfig.from_mapping(eviction)
    reference = run_reference(smollm2_path, prompt_ids, config, max_new_tokens=new_tokens, chunk_size=CHUNK,
                              page_size=BLOCK, ignore_eos=True)
    if config.slack is not None:  # the decode evictions this test is about happen: 39 decode steps, one every 16
        assert sum(e.phase is Phase.DECODE and e.layer == 0 for e in reference.trace) == (new_tokens - 1) // config.slack
    assert list(output.outputs[0].token_ids) == reference.token_ids
    assert len(engine_kept) == len(reference.kept_positions)
    mismatched = [layer for layer, (got, want) in enumerate(zip(engine_kept, reference.kept_positions))
                  if not torch.equal(got, want.to(got.dtype))]
    assert not mismatched, f"layers whose kept tokens differ: {mismatched}"
    return engine
