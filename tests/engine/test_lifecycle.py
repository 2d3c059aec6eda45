"""Request lifecycle with eviction: per-request overrides in a mixed batch, bad requests, preemption,
abort, and the multiprocess executor (plans cross a pickle boundary)."""

from __future__ import annotations

import pytest
from vllm.exceptions import VLLMValidationError

from tests.engine.helpers import (BLOCK, MULTIPROCESS_SERVER, assert_worker_rows_clean, chosen_logprobs, greedy,
                                  token_prompt)

pytestmark = pytest.mark.engine


def step_all(engine, requests):
    """Add (name, prompt, params) requests, step to completion; return outputs and per-step cached
    tokens per request name."""
    llm_engine = engine.llm.llm_engine
    for name, prompt, params in requests:
        llm_engine.add_request(name, prompt, params)
    outputs, cached = {}, {name: [] for name, _, _ in requests}
    preempted = set()
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = out
        for request_id, request in engine.scheduler.requests.items():
            name = request_id.rsplit("-", 1)[0]
            cached[name].append((request.num_computed_tokens, engine.scheduler.num_cached_tokens(request_id)))
            if request.num_preemptions:
                preempted.add(name)
    return outputs, cached, preempted


def test_mixed_batch_with_per_request_overrides(tiny_llama, engine_factory):
    plain = engine_factory(tiny_llama)
    prompt_b = token_prompt(300, 7)
    expected_b = chosen_logprobs(plain.llm.generate([prompt_b], greedy(40))[0])

    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 64, "window": 16})
    outputs, cached, _ = step_all(engine, [
        ("A", token_prompt(300, 3), greedy(40)),
        ("B", prompt_b, greedy(40, kv_eviction="none")),
        ("C", token_prompt(300, 11), greedy(40, kv_eviction="keydiff", kv_budget=160)),
        ("D", token_prompt(300, 13), greedy(40, kv_budget=40, kv_eviction_config={"window": 8})),
    ])
    assert sorted(outputs) == ["A", "B", "C", "D"]
    assert chosen_logprobs(outputs["B"]) == pytest.approx(expected_b, abs=1e-5)  # eviction off for B
    assert all(logical == phys for logical, phys in cached["B"])
    # Default slacks: SnapKV's is 4 windows, at most half the budget, in pages (A: 32, D: 20 -> 32); KeyDiff's a page.
    for name, budget, slack in (("A", 64, 32), ("C", 160, BLOCK), ("D", 40, 32)):
        after_prompt = [phys for logical, phys in cached[name] if logical > 300]
        assert after_prompt and min(after_prompt) >= budget and max(after_prompt) <= budget + slack, name
        assert max(after_prompt) > budget + slack - BLOCK, name  # the default slack, not a smaller one
    assert engine.free_pages() == engine.total_pages()


def test_bad_request_fails_alone_with_a_clear_message(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 64})
    llm_engine = engine.llm.llm_engine
    llm_engine.add_request("good", token_prompt(120), greedy(8))
    with pytest.raises(VLLMValidationError, match=r"invalid per-request KV eviction settings: kv_budget must be an integer in \[1, 2048\], got -5"):
        llm_engine.add_request("bad", token_prompt(50), greedy(4, kv_budget=-5))
    with pytest.raises(VLLMValidationError, match=r"unknown eviction policy 'nope'"):
        llm_engine.add_request("bad2", token_prompt(50), greedy(4, kv_eviction="nope"))
    with pytest.raises(VLLMValidationError, match=r"budget 8 must be larger than the 32 tokens snapkv always keeps"):
        engine.llm.generate([token_prompt(50)], greedy(4, kv_budget=8))
    finished = []
    while llm_engine.has_unfinished_requests():
        finished.extend(o.request_id for o in llm_engine.step() if o.finished)
    assert finished == ["good"]


def test_eviction_requests_on_a_server_without_eviction_are_refused(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama)
    with pytest.raises(VLLMValidationError, match="this server runs without KV eviction"):
        engine.llm.generate([token_prompt(20)], greedy(2, kv_budget=64))
    assert len(engine.llm.generate([token_prompt(20)], greedy(2))[0].outputs[0].token_ids) == 2


# SnapKV: decoding requests are lent window pages while the pool has free ones; a preempted request's loan
# goes back with its pages, and its resumed windows borrow afresh (or accumulate).
WINDOW_SERVER = {"policy": "snapkv", "budget": 64, "schedule": "chunked"}


@pytest.mark.parametrize("server,pages", [pytest.param({"policy": "keydiff", "budget": 64}, 15, id="keydiff"),
                                          pytest.param(WINDOW_SERVER, 15, id="snapkv-windows")])
def test_preemption_recompute_with_eviction(tiny_llama, engine_factory, server, pages):
    plain = engine_factory(tiny_llama)
    prompt_big = token_prompt(200, 21)
    expected_big = chosen_logprobs(plain.llm.generate([prompt_big], greedy(200))[0])

    # 13 pages (416 tokens): the request without eviction grows to 400 tokens and pushes the others out.
    engine = engine_factory(tiny_llama, server, pages=pages, max_model_len=1024)
    assert engine.total_pages() == 13  # the null page and a share for positions (and states) aside
    outputs, cached, preempted = step_all(engine, [
        ("big", prompt_big, greedy(200, kv_eviction="none")),
        ("e1", token_prompt(200, 22), greedy(120)),
        ("e2", token_prompt(200, 23), greedy(120)),
    ])
    assert sorted(outputs) == ["big", "e1", "e2"]
    assert preempted, "the test setup did not cause any preemption"
    assert chosen_logprobs(outputs["big"]) == pytest.approx(expected_big, abs=1e-5)
    for name in ("e1", "e2"):
        assert len(outputs[name].outputs[0].token_ids) == 120
        assert max(phys for _, phys in cached[name]) <= 64 + 64  # budget + one chunk, also after resuming
    assert engine.free_pages() == engine.total_pages()
    assert not engine.scheduler.evicted and not engine.scheduler.eviction_configs
    assert not engine.scheduler.window_pages.lent


def test_abort_returns_every_page(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, {"policy": "h2o", "budget": 64})
    llm_engine = engine.llm.llm_engine
    llm_engine.add_request("keep", token_prompt(300, 1), greedy(30))
    llm_engine.add_request("drop", token_prompt(300, 2), greedy(300))
    while True:
        llm_engine.step()
        ids = {r.split("-", 1)[0]: r for r in engine.scheduler.requests}
        if "drop" in ids and engine.scheduler.evicted.get(ids["drop"], 0) > 0:
            break
    llm_engine.abort_request([ids["drop"]], internal=True)
    assert ids["drop"] not in engine.scheduler.eviction_configs
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    llm_engine.add_request("after", token_prompt(10, 3), greedy(2))
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    assert engine.free_pages() == engine.total_pages()
    assert engine.runner.evict_view.row_of(ids["drop"]) is None
    assert_worker_rows_clean(engine, pending_finish=True)


def test_multiprocess_executor_matches_in_process(tiny_llama, engine_factory, multiprocess_run):
    engine = engine_factory(tiny_llama, MULTIPROCESS_SERVER)
    prompts, params = [token_prompt(200, 5), token_prompt(90, 6)], greedy(30, kv_eviction="keydiff")
    in_process = [chosen_logprobs(o) for o in engine.llm.generate(prompts, params)]
    no_eviction = chosen_logprobs(engine.llm.generate([prompts[0]], greedy(30, kv_eviction="none"))[0])
    assert in_process[0] != pytest.approx(no_eviction, abs=1e-6)  # eviction really changed something
    multi = multiprocess_run["keydiff_logprobs"]  # the same requests in vLLM's multiprocess engine
    assert len(multi) == len(in_process)
    for got, want in zip(multi, in_process):
        assert got == pytest.approx(want, abs=1e-5)


def test_request_that_can_never_fit_is_refused_not_stuck(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, {"policy": "keydiff", "budget": 64}, pages=16, max_model_len=4096)
    # The pool is what is left of 16 pages once eviction's own buffers are counted in the KV memory.
    usable = engine.total_pages()
    assert 0 < usable < 35
    with pytest.raises(VLLMValidationError, match=rf"this request needs up to 1100 tokens of KV cache \(35 pages\) "
                                                  rf"but the pool holds {usable} pages"):
        engine.llm.generate([token_prompt(1000)], greedy(100, kv_eviction="none"))
    out = engine.llm.generate([token_prompt(1000)], greedy(4))[0]  # with eviction it fits
    assert len(out.outputs[0].token_ids) == 4
