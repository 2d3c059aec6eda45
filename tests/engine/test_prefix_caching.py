"""Prefix caching with eviction (engine/prefix_sharing.py) on the real engine: requests that share a
prompt prefix find it in the cache, keep what they would keep without prefix caching, and no page a
prefix match can return is ever written."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.helpers import chosen_logprobs, greedy, token_prompt
from tests.engine.test_stats import delta, settle, snapshot
from vllm_evict.metrics import Metric

SHARED = token_prompt(160)["prompt_token_ids"]  # five pages of 32
PROMPTS = [{"prompt_token_ids": SHARED + token_prompt(100, offset=7 + k)["prompt_token_ids"]} for k in range(3)]
GENERATED = 24


def sharing(engine: Any) -> Any:
    return engine.scheduler.sharing


def assert_pool_back(engine: Any) -> None:
    """Every page is back in vLLM's pool, with no reference left (hashed ones may stay cached there)."""
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert engine.free_pages() == engine.total_pages()
    assert all(block.ref_cnt == 0 for block in pool.blocks if not block.is_null)
    assert not sharing(engine).retained and not sharing(engine).now and not sharing(engine).private


def run(engine: Any, prompts: list[dict], *, one_by_one: bool) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens and prefix-cache hit tokens of every prompt, served one after another or together."""
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    outputs = [o for batch in batches for o in engine.llm.generate(batch, greedy(GENERATED), use_tqdm=False)]
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens or 0 for o in outputs]


# Prefix-cache hits, one request after another: the first computes the shared pages; pages are hashed only
# until a request first writes into its cache. SnapKV evicts once, at the prompt's end: the second finds all
# five shared pages. KeyDiff evicts block-wise in prefill, first after 128 tokens (64-token chunks, budget 96):
# the first request hashed four shared pages, the second computes the fifth (and hashes it before its first
# eviction, in that step), the third finds five. H2O's state starts from every query since a token arrived:
# it reads no prefix, nor does CriticalKV, whose ||v W_O||_1 of a token only a CriticalKV request computes.
HITS = {"snapkv": [0, 160, 160], "keydiff": [0, 128, 160], "h2o": [0, 0, 0], "criticalkv+snapkv": [0, 0, 0]}
PRIVATE = {"h2o", "criticalkv+snapkv"}


@pytest.mark.parametrize("policy", sorted(HITS))
def test_shared_prefix_keeps_what_eviction_keeps_without_prefix_caching(engine_factory: Any, tiny_llama: str,
                                                                        policy: str) -> None:
    eviction = {"policy": policy, "budget": 96}
    off = engine_factory(tiny_llama, eviction, enable_prefix_caching=False)
    expected = [run(off, PROMPTS, one_by_one=True)[0], run(off, PROMPTS, one_by_one=False)[0]]
    on = engine_factory(tiny_llama, eviction, enable_prefix_caching=True)
    for i, one_by_one in enumerate((True, False)):
        tokens, hits = run(on, PROMPTS, one_by_one=one_by_one)
        assert tokens == expected[i]
        if one_by_one:
            assert hits == HITS[policy]
        elif policy not in PRIVATE:  # together, after the cache holds the prefix: every request finds it
            assert min(hits) >= 128
    assert_pool_back(on)
    if policy not in PRIVATE:
        assert sharing(on).copied_pages > 0


def run_logprobs(engine: Any, prompts: list[tuple[dict, str]]) -> tuple[list[float], list[int]]:
    """One request after another, each with its own method (``kv_eviction``): the chosen logprobs of all
    (one list) and each one's prefix-cache hit tokens."""
    outputs = [engine.llm.generate([p], greedy(GENERATED, kv_eviction=m), use_tqdm=False)[0] for p, m in prompts]
    return [x for o in outputs for x in chosen_logprobs(o)], [o.num_cached_tokens or 0 for o in outputs]


# The same prompt again: vLLM would hand the second request every full page (256 of 260 tokens), but a
# cached token's query is not recomputed, and SnapKV's window reads the last 32 queries of the prompt:
# the hit stops at the page before the window (224). TOVA reads the last query only: 256.
REPEAT_HITS = {"snapkv": 224, "tova": 256}


@pytest.mark.parametrize("policy", sorted(REPEAT_HITS))
def test_a_repeated_prompt_computes_the_queries_its_window_reads(engine_factory: Any, tiny_llama: str,
                                                                 policy: str) -> None:
    eviction = {"policy": policy, "budget": 96}
    twice = [(PROMPTS[0], policy)] * 2
    expected, _ = run_logprobs(engine_factory(tiny_llama, eviction, enable_prefix_caching=False), twice)
    logprobs, hits = run_logprobs(engine_factory(tiny_llama, eviction, enable_prefix_caching=True), twice)
    assert hits == [0, REPEAT_HITS[policy]]
    assert logprobs == pytest.approx(expected, abs=1e-5)


def test_pages_a_request_without_eviction_computed_read_as_its_own(engine_factory: Any, tiny_llama: str) -> None:
    """A request without eviction writes its tokens' positions and zeroes their states too: TOVA (which
    matches the layer's heads by position) and SnapKV (which adds its window's mass to a state) finding
    its pages keep what they keep without prefix caching, in a pool an evicting request has dirtied (its
    window mass and compacted positions left in the pages it freed)."""
    eviction = {"policy": "snapkv", "budget": 96, "request_policies": ["snapkv", "tova"]}
    dirty = token_prompt(300, offset=90)
    order = [(dirty, "snapkv"), (dirty, "snapkv"), (PROMPTS[0], "none"), (PROMPTS[1], "tova"), (PROMPTS[2], "snapkv")]
    expected, _ = run_logprobs(engine_factory(tiny_llama, eviction, enable_prefix_caching=False, pages=24,
                                              max_model_len=512), order)
    on = engine_factory(tiny_llama, eviction, enable_prefix_caching=True, pages=24, max_model_len=512)
    logprobs, hits = run_logprobs(on, order)
    assert hits[2:] == [0, 160, 160]
    assert logprobs == pytest.approx(expected, abs=1e-5)
    # What every page vLLM may hand out holds: each KV head's positions are its page's logical ones, and
    # every state is 0 (nothing was added to a hashed page).
    pool, buffers, page = on.scheduler.kv_cache_manager.block_pool, on.runner.evict_buffers, 32
    hashed = [b.block_id for b in pool.blocks if not b.is_null and b.block_hash is not None]
    assert len(hashed) >= 5
    for block_id in hashed:
        positions = buffers.positions[:, block_id].long()  # [L, H, page]
        first = positions[..., :1]
        assert torch.equal(positions, first + torch.arange(page)) and bool((first % page == 0).all())
        for name, state in buffers.states.items():
            assert not state[:, block_id].any(), f"hashed page {block_id} holds {name}"


def test_no_eviction_is_vanilla_with_prefix_caching(engine_factory: Any, tiny_llama: str) -> None:
    """A budget above every request's length evicts nothing: tokens and hits are vanilla's."""
    vanilla = engine_factory(tiny_llama, None, enable_prefix_caching=True)
    expected = run(vanilla, PROMPTS, one_by_one=True)
    on = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 1024}, enable_prefix_caching=True)
    assert run(on, PROMPTS, one_by_one=True) == expected
    assert expected[1] == [0, 160, 160]
    assert sharing(on).copied_pages == 0 and sharing(on).uncached_pages == 0


class HashedPages:
    """Fails the moment a page vLLM may hand to a prefix match differs from what it held when first seen
    hashed: K and V in every layer, and eviction's positions of it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seen: dict[tuple[int, Any], torch.Tensor] = {}
        self.checked = 0

    def content(self, block_id: int) -> torch.Tensor:
        runner = self.engine.runner
        parts = [torch.cat([c.k[block_id].reshape(-1), c.v[block_id].reshape(-1)]).float()
                 for c in runner.evict_layers]
        parts.append(runner.evict_buffers.positions[:, block_id].reshape(-1).float())
        return torch.cat(parts)

    def check(self) -> None:
        pool = self.engine.scheduler.kv_cache_manager.block_pool
        for block in pool.blocks:
            if block.is_null or block.block_hash is None:
                continue
            key = (block.block_id, block.block_hash)
            now = self.content(block.block_id)
            if key not in self.seen:
                self.seen[key] = now
            else:
                assert torch.equal(self.seen[key], now), f"hashed page {block.block_id} was written"
                self.checked += 1
        scheduler = self.engine.scheduler
        for request_id in sharing(self.engine).private & set(scheduler.requests):
            for block in scheduler.attention_manager.req_to_blocks.get(request_id, ()):
                assert pool.is_block_writable(block), f"request {request_id} writes page {block.block_id}, " \
                                                      "which is hashed or shared"


def step_all(engine: Any, guard: HashedPages, arrivals: dict[int, list[tuple[str, dict, Any]]],
             abort: dict[int, str] | None = None) -> dict[str, list[int]]:
    """Drive the engine step by step: requests arrive (and are aborted) at given steps; ``guard`` checks
    the hashed pages after every step."""
    llm_engine = engine.llm.llm_engine
    done: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or llm_engine.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(step, []):
            llm_engine.add_request(request_id, prompt, params or greedy(GENERATED))
        if abort and step in abort:
            llm_engine.abort_request([abort[step]])
        for output in llm_engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
        guard.check()
        step += 1
        assert step < 500
    return done


def test_no_hashed_page_is_written(engine_factory: Any, tiny_llama: str) -> None:
    """Shared prefixes, staggered arrivals, an abort and preemptions in a pool too small for everyone (a
    request without eviction that shares the prefix grows to 500 tokens): every hashed page keeps its
    bytes, every evicting request holds only pages it may write, and every page goes back."""
    # A one-page slack (SnapKV's default is 48 tokens here): admission reserves less, so more run at once and
    # the pool runs short.
    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 96, "slack": 16}, enable_prefix_caching=True,
                            pages=24, max_model_len=512)
    guard = HashedPages(engine)
    preempted: list[str] = []
    scheduler = engine.scheduler
    original = scheduler._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = spy
    prompts = PROMPTS + [{"prompt_token_ids": SHARED + token_prompt(130, offset=40)["prompt_token_ids"]}]
    big = {"prompt_token_ids": SHARED + token_prompt(40, offset=50)["prompt_token_ids"]}
    arrivals = {0: [("a", prompts[0], None), ("b", prompts[1], None)],
                2: [("big", big, greedy(300, kv_eviction="none"))],
                3: [("c", prompts[2], None), ("d", prompts[3], None)], 9: [("e", prompts[0], None)]}
    done = step_all(engine, guard, arrivals, abort={6: "b"})
    assert set(done) == {"a", "c", "d", "e", "big"} and len(done["big"]) == 300
    assert guard.checked > 0 and sharing(engine).copied_pages > 0
    assert preempted, "the pool was meant to be short enough to preempt"
    assert_pool_back(engine)


def test_kv_events_describe_the_prefix_cache(engine_factory: Any, tiny_llama: str) -> None:
    """What a prefix-aware router learns from BlockStored / BlockRemoved is what the cache holds, also
    when a short pool takes a request's own pages out of the cache instead of copying them."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 96}, enable_prefix_caching=True,
                            pages=20, max_model_len=512, disable_log_stats=False,
                            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    batches: list[Any] = []
    engine.scheduler.kv_event_publisher.publish = batches.append
    guard = HashedPages(engine)
    arrivals = {0: [("a", PROMPTS[0], None), ("b", PROMPTS[1], None)], 2: [("c", PROMPTS[2], None)],
                8: [("d", PROMPTS[0], None)]}
    before = snapshot(engine)
    step_all(engine, guard, arrivals)
    after = settle(engine)
    # what the operator sees of it (docs/observability.md)
    assert delta(before, after, Metric.PREFIX_COPIED_PAGES.value) == sharing(engine).copied_pages > 0
    assert delta(before, after, Metric.PREFIX_UNCACHED_PAGES.value) == sharing(engine).uncached_pages
    router: set[Any] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                router.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                router.difference_update(event.block_hashes)
    pool = engine.scheduler.kv_cache_manager.block_pool
    cached = {maybe_convert_block_hash(get_block_hash(b.block_hash)) for b in pool.blocks
              if not b.is_null and b.block_hash is not None}
    assert router == cached and cached
    assert sharing(engine).uncached_pages > 0, "the pool was meant to be short enough to uncache a page"
    assert_pool_back(engine)
