"""The batched eviction step keeps, for every request of a mixed batch, exactly what the per-request
reference keeps: requests with different policies, budgets, lengths and phases share steps (one
evicting its prompt while another decodes), and each one's kept logical positions per (layer, KV
head) equal those of the HF reference runner replaying that request alone with the chunk sizes the
engine gave it."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.engine.helpers import BLOCK, greedy, token_prompt
from vllm_evict.request_settings import resolve_request_config
from vllm_evict.reference import load_model, run_reference

pytestmark = pytest.mark.engine

SERVER = {"policy": "snapkv", "budget": 64, "window": 16,
          "request_policies": ["keydiff", "h2o", "caote+snapkv", "random"]}  # the per-request methods below
# name -> (prompt length, extra_args)
REQUESTS = {
    "snap": (210, {}),
    "keydiff": (300, {"kv_eviction": "keydiff", "kv_budget": 48}),
    "h2o": (150, {"kv_eviction": "h2o", "kv_budget": 80}),
    "caote": (260, {"kv_eviction": "caote+snapkv", "kv_budget": 40,
                    "kv_eviction_config": '{"window": 8}'}),
    "random": (190, {"kv_eviction": "random", "kv_budget": 50, "kv_eviction_config": '{"seed": 7}'}),
    "short": (30, {"kv_budget": 36}),  # never evicts its prompt, evicts while decoding
    "full": (120, {"kv_eviction": "none"}),
}
NEW_TOKENS = 40


def test_mixed_batch_keeps_what_each_request_keeps_alone(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=8, max_num_batched_tokens=96)
    shared_steps, unscheduled = run_and_compare(engine, tiny_llama, REQUESTS)
    assert any(p == {"prefill", "decode"} for p in shared_steps), "no step mixed prefill and decode"


def test_requests_left_out_of_a_step_keep_their_state(tiny_llama, engine_factory):
    """With a token budget smaller than the running prompts, vLLM leaves running requests out of some
    steps (the worker takes them out of its batch and puts them back later, in another row): their
    evicted counts and recent queries must come back with them."""
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=4, max_num_batched_tokens=128)
    requests = {name: REQUESTS[name] for name in ("keydiff", "caote", "snap", "short")}
    # Steps 5-8 and 14-16 get a budget of one token: one running request computes, the others wait.
    _, unscheduled = run_and_compare(engine, tiny_llama, requests, starved={5, 6, 7, 8, 14, 15, 16})
    assert len(set(unscheduled)) >= 2, "running requests were not left out of a step"


def run_and_compare(engine, model_path, requests, starved=frozenset()):
    """Run ``requests`` together, then compare each one with the reference replaying it alone."""
    runner, scheduler = engine.runner, engine.scheduler
    runner.evict_kept_record = {}
    chunks: dict[str, list[int]] = defaultdict(list)
    shared_steps = []  # (phases seen together in one step) - the batch must really mix them
    unscheduled = []  # running requests a step left out
    original = scheduler.schedule
    budget = scheduler.max_num_scheduled_tokens

    def schedule(*args, **kwargs):
        scheduler.max_num_scheduled_tokens = 1 if len(shared_steps) in starved else budget
        output = original(*args, **kwargs)
        unscheduled.extend(r.request_id for r in scheduler.running
                           if r.request_id not in output.num_scheduled_tokens and r.num_computed_tokens > 0)
        phases = set()
        for request_id, count in output.num_scheduled_tokens.items():
            request = scheduler.requests[request_id]
            before = request.num_computed_tokens - count
            if before < request.num_prompt_tokens:
                chunks[request_id].append(count)
                phases.add("prefill")
            else:
                phases.add("decode")
        shared_steps.append(phases)
        return output

    scheduler.schedule = schedule
    prompts = {name: token_prompt(length, offset=i + 1) for i, (name, (length, _)) in enumerate(requests.items())}
    llm_engine = engine.llm.llm_engine
    for name, (_, extra) in requests.items():
        llm_engine.add_request(name, prompts[name], greedy(NEW_TOKENS, **extra))
    outputs = {}
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = out
    engine.llm.generate([token_prompt(3)], greedy(1, kv_eviction="none"))  # delivers the last finishes
    scheduler.schedule = original
    scheduler.max_num_scheduled_tokens = budget
    model, _ = load_model(model_path, dtype=torch.float32)
    kept_by_name = {request_id.split("-", 1)[0]: kept for request_id, kept in runner.evict_kept_record.items()}
    chunks_by_name = {request_id.split("-", 1)[0]: c for request_id, c in chunks.items()}
    for name, (length, extra) in requests.items():
        config = resolve_request_config(SERVER, extra)
        ids = prompts[name]["prompt_token_ids"]
        reference = run_reference(model, ids, config, max_new_tokens=NEW_TOKENS, chunk_size=chunks_by_name[name],
                                  page_size=BLOCK, ignore_eos=True)
        assert outputs[name].outputs[0].token_ids == reference.token_ids, name
        if config is None:
            continue
        engine_kept = [torch.sort(layer, dim=-1).values for layer in kept_by_name[name]]
        mismatched = [layer for layer, (got, want) in enumerate(zip(engine_kept, reference.kept_positions))
                      if not torch.equal(got.cpu(), want)]
        assert not mismatched, f"{name}: layers {mismatched} keep other tokens than the reference"
        assert reference.trace, f"{name}: nothing was evicted"
    return shared_steps, unscheduled
