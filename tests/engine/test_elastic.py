"""Elastic mode: the budget is a floor; requests are compressed only when the KV pool runs short.

Real engine (tiny random Llama, CPU). The scheduler's plans and preemptions are recorded from outside;
what the requests keep is compared with the HF reference replaying each request alone with the same
chunks and the same compressions before the same steps."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.engine.helpers import BLOCK, assert_worker_rows_clean, chosen_logprobs, greedy, token_prompt
from vllm_evict.request_settings import resolve_request_config
from vllm_evict.reference import load_model, run_reference
from vllm_evict.stats import eviction_stats

pytestmark = pytest.mark.engine

ELASTIC = {"policy": "snapkv", "budget": 64, "window": 16, "mode": "elastic",
           "request_policies": ["keydiff", "h2o", "ahakv"]}  # the per-request methods of REQUESTS


class Recorder:
    """Wraps the scheduler: each request's chunk sizes, the compressions before its steps, and, at every
    preemption, how far each running elastic request was above its floor."""

    def __init__(self, engine):
        self.engine = engine
        scheduler = engine.scheduler
        self.chunks: dict[str, list[int]] = defaultdict(list)
        self.steps: dict[str, int] = defaultdict(int)  # forward steps each request has run
        self.compressions: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.compressed: list[str] = []
        self.tokens_compressed: dict[str, int] = defaultdict(int)  # over the request's life, preemptions too
        self.preemptions: list[tuple[str, dict[str, int]]] = []
        self._schedule, self._preempt = scheduler.schedule, scheduler._preempt_request

        def schedule(*args, **kwargs):
            output = self._schedule(*args, **kwargs)
            plan = output.kv_eviction_plan
            for request_id, keep in plan.compress.items():
                self.compressions[request_id][self.steps[request_id]].append(keep)
                self.compressed.append(request_id)
            for request_id, count in output.num_scheduled_tokens.items():
                request = scheduler.requests[request_id]
                if request.num_computed_tokens - count < request.num_prompt_tokens:
                    self.chunks[request_id].append(count)
                self.steps[request_id] += 1
            return output

        def preempt(request, *args, **kwargs):
            excess = {}
            for r in scheduler.running:
                config = scheduler.config_of(r.request_id)
                if config is not None and config.elastic and r is not request:
                    excess[r.request_id] = scheduler.num_cached_tokens(r.request_id) - config.budget
            self.preemptions.append((request.request_id, excess))
            # Recompute-preemption restarts the request: what it recorded so far is void.
            for table in (self.chunks, self.steps, self.compressions):
                table.pop(request.request_id, None)
            return self._preempt(request, *args, **kwargs)

        scheduler.schedule, scheduler._preempt_request = schedule, preempt
        compress = scheduler.elastic._compress
        self.compress_calls = 0

        def counted_compress(victim, *args, **kwargs):
            before = scheduler.evicted.get(victim.request_id, 0)
            freed = compress(victim, *args, **kwargs)
            self.tokens_compressed[victim.request_id] += scheduler.evicted.get(victim.request_id, 0) - before
            self.compress_calls += freed > 0
            return freed

        scheduler.elastic._compress = counted_compress

    def run(self, requests: dict[str, tuple[dict, dict]], new_tokens: int) -> dict:
        llm_engine = self.engine.llm.llm_engine
        for name, (prompt, extra) in requests.items():
            llm_engine.add_request(name, prompt, greedy(new_tokens, **extra))
        outputs = {}
        while llm_engine.has_unfinished_requests():
            for out in llm_engine.step():
                if out.finished:
                    outputs[out.request_id] = out
        return outputs

    def by_name(self, table: dict) -> dict:
        return {request_id.split("-", 1)[0]: value for request_id, value in table.items()}


def test_memory_to_spare_is_vanilla(tiny_llama, engine_factory):
    """Nothing is short: elastic mode compresses nothing and generates exactly what vanilla vLLM does."""
    prompts = [token_prompt(200 + 40 * i, offset=i) for i in range(4)]
    plain = engine_factory(tiny_llama)
    expected = plain.llm.generate(prompts, greedy(48))
    engine = engine_factory(tiny_llama, ELASTIC)
    recorder = Recorder(engine)
    got = engine.llm.generate(prompts, greedy(48))
    assert not recorder.compressed and not recorder.preemptions
    for want, have in zip(expected, got):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
        assert chosen_logprobs(have) == pytest.approx(chosen_logprobs(want), abs=1e-5)
    assert engine.free_pages() == engine.total_pages()


def test_short_pool_compresses_then_preempts_only_at_the_floor(tiny_llama, engine_factory):
    """A pool far smaller than the demand: requests are compressed instead of preempted, and any
    preemption happens only when no running elastic request is a page above its floor."""
    engine = engine_factory(tiny_llama, ELASTIC, pages=22, max_num_seqs=4, disable_log_stats=False)
    recorder = Recorder(engine)
    outputs = recorder.run({f"r{i}": (token_prompt(300, offset=i), {}) for i in range(6)}, new_tokens=64)
    assert len(outputs) == 6 and all(len(o.outputs[0].token_ids) == 64 for o in outputs.values())
    assert len(set(recorder.compressed)) >= 4, "requests were not compressed"
    # What each request's stats and the metrics report: compressions, told apart from preemptions.
    compressed = recorder.by_name(recorder.tokens_compressed)
    for name, out in outputs.items():
        assert eviction_stats(out).tokens_evicted == compressed.get(name, 0), name
    metrics = {m.name: m.value for m in engine.llm.get_metrics() if not m.labels.keys() - {"model_name", "engine"}
               and hasattr(m, "value")}
    assert metrics["vllm:kv_eviction_elastic_compressions"] == recorder.compress_calls >= len(recorder.compressed)
    assert metrics["vllm:num_preemptions"] == len(recorder.preemptions)
    for preempted, excess in recorder.preemptions:
        assert all(tokens < BLOCK for tokens in excess.values()), f"{preempted} preempted while {excess}"
    assert engine.free_pages() == engine.total_pages()
    assert not engine.scheduler.evicted and not engine.scheduler.pending_keep
    engine.llm.generate([token_prompt(3)], greedy(1))  # the worker hears of the last finishes
    assert_worker_rows_clean(engine)


REQUESTS = {
    "snap": (token_prompt(280, offset=1), {}),
    "keydiff": (token_prompt(240, offset=2), {"kv_eviction": "keydiff", "kv_budget": 48}),
    "h2o": (token_prompt(260, offset=3), {"kv_eviction": "h2o", "kv_budget": 80}),
    "ahakv": (token_prompt(220, offset=4), {"kv_eviction": "ahakv", "kv_budget": 72,
                                            "kv_eviction_config": '{"recent": 16}'}),
}


def test_compressions_keep_what_the_reference_keeps(tiny_llama, engine_factory):
    """Every request keeps exactly what the reference keeps when it replays the request alone with the
    engine's chunks and the engine's compressions before the same steps (one-shot policies included)."""
    engine = engine_factory(tiny_llama, ELASTIC, pages=20, max_num_seqs=4)
    engine.runner.evict_kept_record = {}
    recorder = Recorder(engine)
    outputs = recorder.run(REQUESTS, new_tokens=40)
    engine.llm.generate([token_prompt(3)], greedy(1, kv_eviction="none"))  # delivers the last finishes
    assert not recorder.preemptions, "the pool is sized so that compression suffices"
    compressions, chunks = recorder.by_name(recorder.compressions), recorder.by_name(recorder.chunks)
    kept = recorder.by_name(engine.runner.evict_kept_record)
    assert set(compressions) == set(REQUESTS), f"not every request was compressed: {sorted(compressions)}"
    model, _ = load_model(tiny_llama, dtype=torch.float32)
    for name, (prompt, extra) in REQUESTS.items():
        config = resolve_request_config(ELASTIC, extra)
        reference = run_reference(model, prompt["prompt_token_ids"], config, max_new_tokens=40,
                                  chunk_size=chunks[name], page_size=BLOCK, ignore_eos=True,
                                  compressions=compressions[name])
        assert outputs[name].outputs[0].token_ids == reference.token_ids, name
        engine_kept = [torch.sort(layer, dim=-1).values.cpu() for layer in kept[name]]
        bad = [i for i, (a, b) in enumerate(zip(engine_kept, reference.kept_positions)) if not torch.equal(a, b)]
        assert not bad, f"{name}: layers {bad} keep other tokens than the reference"


def test_requests_without_eviction_are_never_compressed(tiny_llama, engine_factory):
    """A request that asks for kv_eviction "none" keeps its whole cache (it may be preempted, as in vLLM),
    and requests in fixed mode are never compressed by the elastic rule."""
    engine = engine_factory(tiny_llama, ELASTIC, pages=22, max_num_seqs=4)
    recorder = Recorder(engine)
    requests = {"full": (token_prompt(300, offset=9), {"kv_eviction": "none"}),
                "fixed": (token_prompt(300, offset=8), {"kv_eviction_config": '{"mode": "fixed"}'}),
                **{f"e{i}": (token_prompt(300, offset=i), {}) for i in range(3)}}
    outputs = recorder.run(requests, new_tokens=48)
    assert len(outputs) == 5
    names = {r.split("-", 1)[0] for r in recorder.compressed}
    assert names and not names & {"full", "fixed"}, names
    assert engine.free_pages() == engine.total_pages()


def test_prompt_larger_than_the_pool_completes(tiny_llama, engine_factory):
    """The start-up bound holds in elastic mode: a prompt four times the pool compresses itself between
    its chunks and completes."""
    pages = 16
    engine = engine_factory(tiny_llama, {"policy": "keydiff", "budget": 64, "mode": "elastic"}, pages=pages,
                            max_model_len=4096)
    recorder = Recorder(engine)
    outputs = recorder.run({"long": (token_prompt(4 * pages * BLOCK), {})}, new_tokens=8)
    assert len(outputs["long"].outputs[0].token_ids) == 8
    assert len(recorder.compressed) > 4 and not recorder.preemptions
    assert engine.free_pages() == engine.total_pages()


def test_aborts_and_preemptions_leave_the_pool_whole(tiny_llama, engine_factory):
    """Compressions mixed with vLLM's preemptions and with aborts: every page comes back. Requests without
    eviction grow until vLLM must preempt."""
    engine = engine_factory(tiny_llama, {**ELASTIC, "budget": 48}, pages=20, max_num_seqs=4)
    recorder = Recorder(engine)
    llm_engine = engine.llm.llm_engine
    for i in range(2):
        llm_engine.add_request(f"n{i}", token_prompt(150, offset=10 + i), greedy(100, kv_eviction="none"))
    for i in range(4):
        llm_engine.add_request(f"r{i}", token_prompt(260, offset=i), greedy(80))
    aborted = False
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        if not aborted and len(recorder.compressed) >= 3:
            victim = next(r for r in engine.scheduler.requests if r.startswith("r1"))
            llm_engine.abort_request([victim], internal=True)
            aborted = True
    assert aborted and recorder.preemptions, "the run should see both compressions and preemptions"
    assert engine.free_pages() == engine.total_pages()
    assert not engine.scheduler.evicted and not engine.scheduler.eviction_configs
    engine.llm.generate([token_prompt(3)], greedy(1))
    assert_worker_rows_clean(engine)
