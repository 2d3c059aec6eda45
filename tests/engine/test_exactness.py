"""The engine with eviction must reproduce plain vLLM exactly whenever nothing is evicted, whatever
order the cached slots are in (per head), and it must run for every policy."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import cached_pages, chosen_logprobs, greedy, token_prompt
from vllm_evict import paged

pytestmark = pytest.mark.engine

PROMPTS = [token_prompt(150, 1), token_prompt(37, 5), token_prompt(260, 9)]


def test_budget_above_every_length_matches_plain_vllm(tiny_llama, engine_factory):
    plain = engine_factory(tiny_llama)
    expected = [chosen_logprobs(o) for o in plain.llm.generate(PROMPTS, greedy(24))]
    evicting = engine_factory(tiny_llama, {"policy": "caote+snapkv", "budget": 1024})
    outputs = evicting.llm.generate(PROMPTS, greedy(24))
    for want, got in zip(expected, map(chosen_logprobs, outputs)):
        assert got == pytest.approx(want, abs=1e-5)
    assert type(evicting.scheduler).__name__ == "EvictScheduler"
    assert evicting.free_pages() == evicting.total_pages()


def test_random_per_head_permutation_of_cached_slots_keeps_logprobs(tiny_llama, engine_factory):
    """Shuffle every layer's cached tokens with a different permutation per KV head after the
    prompt; attention must not notice (catches K/V layout and view bugs)."""
    plain = engine_factory(tiny_llama)
    prompt = token_prompt(150, 3)
    expected = chosen_logprobs(plain.llm.generate([prompt], greedy(16))[0])

    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 1024})
    llm_engine = engine.llm.llm_engine
    llm_engine.add_request("perm", prompt, greedy(16))
    generator = torch.Generator().manual_seed(0)
    outputs = []
    permuted = False
    while llm_engine.has_unfinished_requests():
        outputs.extend(o for o in llm_engine.step() if o.finished)
        request = next(iter(engine.scheduler.requests.values()), None)  # vLLM suffixes request ids
        if not permuted and request is not None and request.num_computed_tokens >= 150:
            runner = engine.runner
            cached = request.num_computed_tokens
            block_ids = cached_pages(runner, request.request_id, cached)  # nothing evicted: physical == logical
            for layer in runner.evict_layers:
                k_view, v_view = layer.k, layer.v
                heads = k_view.shape[1]
                order = torch.stack([torch.randperm(cached, generator=generator) for _ in range(heads)])
                before = paged.gather_tokens(k_view, block_ids.view(1, -1), cached)[0].clone()
                paged.permute_tokens([k_view, v_view], block_ids, order)
                after = paged.gather_tokens(k_view, block_ids.view(1, -1), cached)[0]
                assert torch.equal(after[1], before[1][order[1]])
            permuted = True
    assert permuted
    got = chosen_logprobs(outputs[0])
    assert got == pytest.approx(expected, abs=1e-5)
