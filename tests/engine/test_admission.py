"""Admission is never later with eviction than without: a request waits only when vanilla vLLM, with
the same pool and the same requests, would make it wait too.

vLLM admits a waiting request only if the pool can hold all the tokens it has now (its prompt), plus a
watermark of pages. Under eviction the plugin replaces that check with one sized by
``schedule.physical_bound``: never more than the prompt, and budget + one chunk for a long prompt.
"""

from __future__ import annotations

import math

import pytest

from tests.engine.helpers import BLOCK, greedy, token_prompt
from vllm_evict.schedule import physical_bound

pytestmark = pytest.mark.engine

CHUNK = 512
BUDGET = 64
POLICY = {"policy": "keydiff", "budget": BUDGET, "schedule": "chunked"}
PAGES = 26  # the pool: 25 usable pages (vLLM keeps one null page)
RUNNING_PROMPT = 150
SHORT_PROMPT, LONG_GENERATION = 40, 700


def engine_kwargs(**overrides):
    return {**dict(pages=PAGES, max_num_batched_tokens=CHUNK, max_model_len=800, max_num_seqs=4), **overrides}


def pages_held(engine, request_id: str) -> int:
    manager = engine.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return len(manager.req_to_blocks.get(request_id, ()))


def admission_trace(engine, running: int = 3, running_tokens: int = 300, warmup_steps: int = 3,
                    steps_after: int = 70, prompt_len: int = SHORT_PROMPT) -> dict:
    """``running`` requests run; then a prompt of ``prompt_len`` tokens with a long generation arrives.
    Returns the free pages when it arrived, the step (counted from its arrival) in which it was first
    scheduled, and the most pages it held in the following ``steps_after`` steps; then everything is
    aborted."""
    llm_engine = engine.llm.llm_engine
    ids = [f"run-{i}" for i in range(running)] + ["short"]
    for i, request_id in enumerate(ids[:running]):
        llm_engine.add_request(request_id, token_prompt(RUNNING_PROMPT, offset=10 + i), greedy(running_tokens))
    for _ in range(1 + warmup_steps):
        llm_engine.step()
    free_at_arrival = engine.free_pages()
    generated = min(r.num_output_tokens for r in engine.scheduler.requests.values())
    llm_engine.add_request("short", token_prompt(prompt_len, offset=3), greedy(LONG_GENERATION))
    internal = next(r for r in engine.scheduler.requests if r.split("-", 1)[0] == "short")  # vLLM adds a suffix
    request = engine.scheduler.requests[internal]
    admitted_at, peak_pages = None, 0
    for step in range(1, steps_after + 1):
        llm_engine.step()
        if admitted_at is None and request.num_computed_tokens > 0:
            admitted_at = step
        peak_pages = max(peak_pages, pages_held(engine, internal))
    cached = request.num_computed_tokens
    llm_engine.abort_request(ids)
    llm_engine.step()
    return {"free_at_arrival": free_at_arrival, "generated_at_arrival": generated, "admitted_at": admitted_at,
            "peak_pages": peak_pages, "computed": cached, "free_after": engine.free_pages(),
            "total": engine.total_pages()}


def test_short_prompt_long_generation_is_admitted_when_vanilla_admits_it(tiny_llama, engine_factory):
    vanilla = admission_trace(engine_factory(tiny_llama, **engine_kwargs()))
    evicting_engine = engine_factory(tiny_llama, POLICY, **engine_kwargs())
    evicting = admission_trace(evicting_engine)
    # The situation the old bound (budget + chunk for any prompt: 576 tokens, 18 pages) would delay.
    old_bound_pages = math.ceil(min(SHORT_PROMPT + LONG_GENERATION, BUDGET + CHUNK) / BLOCK)
    assert evicting["free_at_arrival"] < old_bound_pages
    assert vanilla["admitted_at"] == evicting["admitted_at"] == 1
    # Page bounds still hold (it decoded past budget + slack), and every page comes back.
    assert evicting["computed"] > BUDGET + BLOCK
    lifetime = physical_bound(prompt_len=SHORT_PROMPT, max_new_tokens=LONG_GENERATION, budget=BUDGET,
                              schedule="chunked", slack=BLOCK, chunk=CHUNK)
    assert evicting["peak_pages"] <= math.ceil(lifetime / BLOCK) == math.ceil((BUDGET + BLOCK) / BLOCK)
    for trace in (vanilla, evicting):
        assert trace["free_after"] == trace["total"]


def test_watermark_holds_back_waiting_requests_as_in_vllm(tiny_llama, engine_factory):
    # Chunks of 64 tokens; one request runs. A 300-token prompt arrives: under eviction it reserves
    # budget + chunk = 128 tokens (4 pages), its first chunk needs 2. 19 of 26 pages are the watermark:
    # the first chunk fits with the watermark, the reservation does not, so it waits, as vLLM's own
    # full-sequence check makes it wait, until the running request finishes (no watermark applies
    # when nothing else runs).
    kwargs = engine_kwargs(watermark=0.74, max_num_batched_tokens=64)
    engine = engine_factory(tiny_llama, POLICY, **kwargs)
    watermark = engine.scheduler.kv_cache_manager.watermark_blocks
    run = dict(running=1, running_tokens=20, steps_after=30, prompt_len=300)
    trace = admission_trace(engine, **run)
    reserved, first_chunk = math.ceil((BUDGET + 64) / BLOCK), math.ceil(64 / BLOCK)
    assert first_chunk + watermark <= trace["free_at_arrival"] < reserved + watermark
    vanilla = admission_trace(engine_factory(tiny_llama, **kwargs), **run)
    # It starts in the step after the running request's last token.
    assert trace["generated_at_arrival"] == vanilla["generated_at_arrival"] == 2
    assert trace["admitted_at"] == vanilla["admitted_at"] == 20 - 2 + 1
