"""The engine must evict exactly what the HF reference runner evicts: same kept logical positions per
layer and KV head, same greedy tokens, for each schedule (real SmolLM2 weights, fp32)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import BLOCK, TEST_RUNNER, greedy
from vllm_evict import EvictionConfig
from vllm_evict.reference import run_reference

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CHUNK = 64
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
          "books were made across Europe. Before that, scribes copied every page by hand, which made books "
          "rare and expensive. ") * 6


def engine_kept_positions(engine, prompt_ids, params):
    runner = engine.runner
    runner.evict_kept_record = {}
    output = engine.llm.generate([{"prompt_token_ids": prompt_ids}], params)[0]
    # The worker hears of the finish with the next step: run one tiny request to deliver it.
    engine.llm.generate([{"prompt_token_ids": prompt_ids[:3]}], greedy(1, kv_eviction="none"))
    (kept,) = runner.evict_kept_record.values()
    return output, [torch.sort(layer, dim=-1).values for layer in kept]


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
    budget = 96
    eviction = {"policy": spec, "budget": budget, "schedule": schedule}
    engine = engine_factory(str(smollm2_path), eviction, max_num_batched_tokens=CHUNK, pages=0,
                            kv_cache_memory_bytes=160 << 20)
    tokenizer = engine.llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT)["input_ids"][:300]
    output, engine_kept = engine_kept_positions(engine, prompt_ids, greedy(12))

    config = EvictionConfig.from_mapping(eviction)
    reference = run_reference(smollm2_path, prompt_ids, config, max_new_tokens=12, chunk_size=CHUNK,
                              slack=BLOCK, ignore_eos=True)
    assert list(output.outputs[0].token_ids) == reference.token_ids
    assert len(engine_kept) == len(reference.kept_positions)
    mismatched = [layer for layer, (got, want) in enumerate(zip(engine_kept, reference.kept_positions))
                  if not torch.equal(got, want.to(got.dtype))]
    assert not mismatched, f"layers whose kept tokens differ: {mismatched}"
