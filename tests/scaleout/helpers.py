"""Running the real engine with several workers (tensor parallel, Ray) and reading what each rank kept.

Every run goes through the same path whatever the executor: requests are stepped through the in-process
engine core (so the scheduler's page accounting is visible), and the kept positions come back from every
worker through ``LLM.collective_rpc`` (``vllm_evict.engine.debug``), merged by *global* KV head.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from tests.engine.helpers import BLOCK, Engine, chosen_logprobs, greedy, make_llm, token_prompt
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.debug import RankKept, kept_by_global_head, start_recording

CHUNK = 128  # max_num_batched_tokens: the prefill chunk of a request that runs alone
BUDGET = 64
PROMPT_LEN = 256
GEN_LEN = 40  # > every default slack at budget 64 (one page; 32 tokens for window methods): decode evicts

# One request per method, each through a per-request override of the server's snapkv: the overrides and
# their plans cross the executor's serialisation. Each method runs under its paper's default schedule.
POLICIES = ["snapkv", "h2o", "tova", "streamingllm", "knorm", "keydiff", "ahakv", "caote+snapkv",
            "fastcaote+h2o", "criticalkv+snapkv", "random", "nacl"]
SERVER_EVICTION = {"policy": "snapkv", "budget": BUDGET, "seed": 7, "request_policies": POLICIES}
KV_HEADS = {"kv4": 4, "kv1": 1}  # the two test models (conftest.py): model name -> KV heads


def omp_bind_for(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` workers: one allowed core each when there are enough
    (with both ranks' threads floating over both cores a step is ~8x slower), else no binding."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks < 2 or len(cores) < ranks:
        return "nobind"
    per_rank = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Environment for the worker processes an engine starts (read when they start), restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def page_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 4) -> int:
    return layers * kv_heads * head_dim * 2 * dtype_bytes * BLOCK


def start_engine(model: str, *, tp: int, kv_heads: int, pages: int = 512, backend: str | None = None,
                 eviction: dict[str, Any] | None = None, **overrides: Any) -> Engine:
    """The real engine over ``model`` (2 layers, head_dim 32), ``tp`` ranks, ``pages`` pages of KV on each."""
    local_heads = max(1, kv_heads // tp)
    kwargs: dict[str, Any] = dict(tensor_parallel_size=tp, max_num_seqs=len(POLICIES),
                                  max_num_batched_tokens=CHUNK)
    if tp > 1:
        kwargs["distributed_executor_backend"] = backend or "mp"
    kwargs.update(overrides)
    with environment(VLLM_CPU_OMP_THREADS_BIND=omp_bind_for(tp)):
        llm = make_llm(model, SERVER_EVICTION if eviction is None else eviction, pages=0,
                       kv_cache_memory_bytes=pages * page_bytes(2, local_heads, 32), **kwargs)
    return Engine(llm)


def stop_engine(engine: Engine) -> None:
    engine.llm.llm_engine.engine_core.shutdown()


@dataclass
class Outcome:
    """One request's result: tokens, logprobs, and per layer {global KV head: [kept positions per copy]}."""

    tokens: list[int]
    logprobs: list[float]
    kept: list[dict[int, list[list[int]]]] = field(default_factory=list)
    trace: list[tuple[int, int, int]] = field(default_factory=list)  # (logical tokens, pages, cached)


def requests_for(policies: list[str]) -> list[tuple[str, dict[str, Any], Any]]:
    """(name, prompt, params): one prompt per policy, overriding the server's method per request."""
    return [(policy, token_prompt(PROMPT_LEN, offset=3 + 5 * i), greedy(GEN_LEN, kv_eviction=policy))
            for i, policy in enumerate(policies)]


def run_requests(engine: Engine, requests: list[tuple[str, dict[str, Any], Any]]) -> dict[str, Outcome]:
    """Step the requests to completion, recording each one's page use after every step, then read what
    every rank kept."""
    engine.llm.collective_rpc(start_recording)
    llm_engine = engine.llm.llm_engine
    for name, prompt, params in requests:
        llm_engine.add_request(name, prompt, params)
    outcomes: dict[str, Outcome] = {}
    traces: dict[str, list[tuple[int, int, int]]] = {name: [] for name, _, _ in requests}
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outcomes[out.request_id] = Outcome(list(out.outputs[0].token_ids), chosen_logprobs(out))
        for request_id, request in engine.scheduler.requests.items():
            traces[external_id(request_id)].append(
                (request.num_computed_tokens, engine.pages_of(request_id), engine.scheduler.num_cached_tokens(request_id)))
    ranks: list[RankKept] = engine.llm.collective_rpc(kept_by_global_head)
    for name, outcome in outcomes.items():
        outcome.trace = traces[name]
        outcome.kept = merge_ranks(ranks, name)
    return outcomes


def external_id(engine_request_id: str) -> str:
    """vLLM's front end appends '-<8 random characters>' to the id a request was added with."""
    return engine_request_id.rsplit("-", 1)[0]


def merge_ranks(ranks: list[RankKept], name: str) -> list[dict[int, list[list[int]]]]:
    """Per layer, {global KV head: the sorted kept positions reported by each rank holding it}."""
    per_rank = []
    for rank in ranks:
        found = [layers for request_id, layers in rank.kept.items() if external_id(request_id) == name]
        assert len(found) == 1, f"rank {rank.tp_rank} recorded {len(found)} copies of request {name}"
        per_rank.append((rank, found[0]))
    merged: list[dict[int, list[list[int]]]] = [{} for _ in per_rank[0][1]]
    for rank, layers in per_rank:
        for layer, positions in enumerate(layers):
            for local, head in enumerate(rank.global_kv_heads):
                merged[layer].setdefault(head, []).append(torch.sort(positions[local]).values.tolist())
    return merged


def kept_differences(got: Outcome, want: Outcome) -> list[str]:
    """Where ``got`` keeps other positions than ``want`` (one copy per head), including replicas that
    disagree with each other."""
    problems = []
    for layer, (got_heads, want_heads) in enumerate(zip(got.kept, want.kept, strict=True)):
        assert sorted(got_heads) == sorted(want_heads), f"layer {layer}: heads {sorted(got_heads)} vs {sorted(want_heads)}"
        for head, copies in sorted(got_heads.items()):
            (reference,) = want_heads[head]
            for copy, positions in enumerate(copies):
                if positions != reference:
                    extra = sorted(set(positions) - set(reference))
                    problems.append(f"layer {layer} KV head {head} copy {copy}: keeps {extra[:6]}... "
                                    f"({len(extra)} positions) that TP 1 evicted")
    return problems


def page_bound_violations(outcome: Outcome, *, prompt_len: int, config: EvictionConfig) -> list[str]:
    """Pages and cached tokens of one request against the bounds eviction promises."""
    problems = []
    budget, chunked, slack = config.budget, config.schedule == "chunked", config.slack_for(BLOCK)
    prefill_pages = math.ceil((budget + CHUNK) / BLOCK)
    decode_pages = math.ceil((budget + slack) / BLOCK)
    for tokens, pages, cached in outcome.trace:
        if chunked and budget + CHUNK < tokens <= prompt_len and pages > prefill_pages:
            problems.append(f"prefill at {tokens} tokens holds {pages} pages > {prefill_pages}")
        if tokens > prompt_len and (pages > decode_pages or not budget <= cached <= budget + slack):
            problems.append(f"decode at {tokens} tokens holds {pages} pages, {cached} cached "
                            f"(bounds: {decode_pages} pages, {budget}..{budget + slack} tokens)")
    if not any(tokens > prompt_len for tokens, _, _ in outcome.trace):
        problems.append("the request never reached decode")
    return problems
