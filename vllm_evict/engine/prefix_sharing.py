"""Prefix caching with eviction, scheduler side: a page a prefix match can return is never written.

vLLM hashes a request's full pages as it schedules them, and hands a hashed page to any later request
whose prompt starts with the same tokens. Eviction writes into a request's cached slots (compaction, a
window's mass added to every cached token's state, that state's reset), which would corrupt such a
page for everyone who finds it. So a request with eviction on shares pages only until its first step
that writes into them (``schedule.changes_cached_tokens``, the workers' own rules). In that step it
becomes *private*:

* every page it holds that vLLM may hand out (hashed, ``block_hash`` set) or that another request holds
  too (``ref_cnt`` > 1) is replaced by a fresh page; the workers copy each such page into its
  replacement right after the layer's attention (so the copy holds what this step's forward wrote) and
  before anything is written, and the request reads and writes only the replacements from then on. The
  original stays hashed and unchanged. One the request found in the prefix cache, or that another request
  holds too (a prefix proven shared), stays held by the request until it ends, as it would be without
  eviction, so that vLLM does not recycle a prefix running requests share; one it computed alone goes
  back to vLLM's pool once the step has run, as a cached page later requests still find. vLLM's KV events
  (BlockStored / BlockRemoved) keep describing what the pages hold;
* when the pool has no fresh page to spare (beyond vLLM's watermark) for a hashed page only this request
  holds, that page leaves the prefix cache instead (``BlockPool.evict_blocks``, a BlockRemoved event)
  and is written in place; a page another request holds is always copied: the step is scheduled only
  if the pool has room for those copies (``room_for``), as vLLM schedules nothing it cannot allocate;
* from then on vLLM hashes none of its pages (``delay_cache_blocks``): after a compaction, page i no
  longer holds tokens [i * page_size, (i + 1) * page_size).

Requests whose every step writes into cached state (elastic mode, policies with ``needs_every_step``:
H2O, AhaKV) are private from their first step and read no cached prefix: the per-token state they keep
for a token is accumulated from every query since the token arrived, which a page computed by another
request does not carry. So are requests whose method computes a state from each token's K/V as it enters
(``computed_state``: CriticalKV's ||v W_O||_1), which a request of another method does not compute.

What a page found in the cache carries besides K and V: every step writes its tokens' positions and
zeroes their states, with or without eviction (``StepBuilder._record_slots``), so a hit reads what the
request would have written itself. A cached token's query is not recomputed, so a hit stops before the
first query a window read after the prompt needs (``hit_limit``, ``schedule.window_start``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.request import Request

from vllm_evict.schedule import changes_cached_tokens, window_start

if TYPE_CHECKING:
    from vllm_evict.config import EvictionConfig
    from vllm_evict.engine.plan import EvictionPlan
    from vllm_evict.engine.scheduler import EvictScheduler


@dataclass
class Privatized:
    """One request's pages replaced in this step: ``indices`` into its page list, the hashed or shared
    ``sources`` (blocks) and their fresh ``copies`` (blocks), in the same order; ``held``: the sources the
    request keeps holding until it ends (a prefix proven shared), the others go back after the step."""

    indices: list[int]
    sources: list[Any]
    copies: list[Any]
    held: list[Any]


class PrefixSharing:
    def __init__(self, scheduler: "EvictScheduler") -> None:
        self.scheduler = scheduler
        self.enabled = bool(scheduler.kv_cache_manager.enable_caching)
        self.private: set[str] = set()  # requests that hash nothing more and share no page
        self.policies: dict[str, Any] = {}  # the policy of each request that still shares (until it writes)
        self.now: dict[str, Privatized] = {}  # this step's replacements, until the plan carries them
        self.retained: list[Any] = []  # replaced pages, freed once the step that copies them has run
        self.hit_pages: dict[str, int] = {}  # request id -> pages of its prefix found in the cache
        self.pinned: dict[str, list[Any]] = {}  # request id -> shared prefix pages it holds until it ends
        self.copied_pages = 0  # pages copied so far (tests, logs)
        self.uncached_pages = 0  # pages taken out of the prefix cache instead, for want of free pages

    # ---- per request --------------------------------------------------------------------------
    def private_from_start(self, config: "EvictionConfig") -> bool:
        policy = self.scheduler.window_pages.policy_for(config)
        return config.elastic or policy.needs_every_step or bool(policy.computed_state)

    def hit_limit(self, request: Request) -> int | None:
        """The most prefix tokens the request may take from the cache (None: no limit): its hit stops before
        the first query a window read after the prompt needs (``schedule.window_start``), since vLLM does
        not recompute a cached token's query."""
        config = self.scheduler.config_of(request.request_id)
        if config is None:
            return None
        policy = self.scheduler.window_pages.policy_for(config)
        start = window_start(policy, config, prompt_len=request.num_prompt_tokens, page_size=self.scheduler.page_size)
        return None if start is None else start // self.scheduler.page_size * self.scheduler.page_size

    def admit(self, request: Request, config: "EvictionConfig | None") -> None:
        """At ``add_request``: a request whose state cannot start from another request's pages neither
        reads the prefix cache (vLLM's own per-request switch) nor fills it."""
        if self.enabled and config is not None and self.private_from_start(config):
            request.skip_reading_prefix_cache = True
            self.private.add(request.request_id)

    def hashes(self, request_id: str) -> bool:
        """vLLM may hash this request's full pages (it shares them)."""
        return request_id not in self.private

    def found(self, request: Request, hits: int) -> None:
        """vLLM gives the request ``hits`` prefix tokens from the cache (at admission)."""
        if hits:
            self.hit_pages[request.request_id] = hits // self.scheduler.page_size

    def changes(self, request: Request, config: "EvictionConfig", num_new: int, hits: int, evicted: int) -> bool:
        """This step writes into pages the request holds (see the module docstring)."""
        tokens_before = request.num_computed_tokens + hits
        policy = self.policies.get(request.request_id)
        if policy is None:
            policy = self.policies[request.request_id] = self.scheduler.window_pages.policy_for(config)
        return changes_cached_tokens(policy, config, tokens_before=tokens_before, num_new=num_new,
                                     prompt_len=request.num_prompt_tokens, phys_before=tokens_before - evicted,
                                     page_size=self.scheduler.page_size)

    def room_for(self, request: Request, manager: Any, num_new: int, hits: int, new_hit_blocks: int,
                 lookahead: int, evicted: int) -> bool:
        """Whether the pool can give this step's pages and a copy of every page another request holds
        too (an upper bound of both: vLLM's allocation comes first)."""
        scheduler = self.scheduler
        held = scheduler.attention_manager.req_to_blocks.get(request.request_id, [])
        shared = sum(1 for block in held if block.ref_cnt > 1) + new_hit_blocks
        phys_after = request.num_computed_tokens + hits - evicted + num_new + lookahead
        needed = max(cdiv(phys_after, scheduler.page_size) - len(held) - new_hit_blocks, 0) + 1
        return shared + needed <= manager.block_pool.get_num_free_blocks()

    def privatize(self, request: Request, manager: Any) -> None:
        """Right after vLLM allocated this step's pages: take fresh pages for the request's hashed and
        shared ones (they replace them when the step's plan is made), or take its own hashed pages out
        of the prefix cache when the pool is short."""
        request_id = request.request_id
        self.private.add(request_id)
        self.policies.pop(request_id, None)
        pool = manager.block_pool
        blocks = self.scheduler.attention_manager.req_to_blocks[request_id]
        shared, own = [], []
        for index, block in enumerate(blocks):
            if block.is_null:
                continue
            if block.ref_cnt > 1:
                shared.append(index)
            elif block.block_hash is not None:
                own.append(index)
        free = pool.get_num_free_blocks()
        if len(shared) > free:  # room_for checked this before vLLM's allocation
            raise RuntimeError(f"vllm_evict: request {request_id} shares {len(shared)} pages and the pool has "
                               f"{free} free: room_for let through a step it could not copy")
        spare = max(free - len(shared) - manager.watermark_blocks, 0)
        copied = sorted(shared + own[:spare])
        uncached = own[spare:]
        if uncached:
            pool.evict_blocks({blocks[i].block_id for i in uncached})
            self.uncached_pages += len(uncached)
            self.scheduler.accounting.prefix_pages(uncached=len(uncached))
        if copied:
            hit = self.hit_pages.get(request_id, 0)
            self.now[request_id] = Privatized(copied, [blocks[i] for i in copied], pool.get_new_blocks(len(copied)),
                                              [blocks[i] for i in copied if i < hit or blocks[i].ref_cnt > 1])

    # ---- per step -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The pages replaced in the last step were copied by it: they go back to the pool (still hashed:
        a later request finds them)."""
        if self.retained:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(reversed(self.retained))
            self.retained = []

    def finish_step(self, scheduled: dict[str, int], plan: "EvictionPlan") -> None:
        """After vLLM built the step's output (whose page ids are the originals, which this step's forward
        reads and writes): the replacements enter the request's page list and the plan."""
        pool = self.scheduler.kv_cache_manager.block_pool
        for request_id, done in self.now.items():
            blocks = self.scheduler.attention_manager.req_to_blocks.get(request_id)
            if request_id not in scheduled or blocks is None:
                pool.free_blocks(done.copies)  # preempted in the same step: nothing was written into them
                continue
            for index, copy in zip(done.indices, done.copies):
                blocks[index] = copy
            held = {id(b) for b in done.held}
            self.pinned.setdefault(request_id, []).extend(done.held)
            self.retained.extend(b for b in done.sources if id(b) not in held)
            self.copied_pages += len(done.copies)
            self.scheduler.accounting.prefix_pages(copied=len(done.copies))
            plan.copies[request_id] = ([b.block_id for b in done.sources], [b.block_id for b in done.copies])
            plan.pages[request_id] = [b.block_id for b in blocks]
        self.now = {}

    def forget(self, request_id: str, config: "EvictionConfig | None" = None) -> None:
        """Gone, or preempted (``config``: every page went back, and a resumed request shares again
        until it next writes, unless it is private from its start)."""
        self.private.discard(request_id)
        self.policies.pop(request_id, None)
        self.hit_pages.pop(request_id, None)
        pool = self.scheduler.kv_cache_manager.block_pool
        done = self.now.pop(request_id, None)
        if done is not None:
            pool.free_blocks(done.copies)
        pins = self.pinned.pop(request_id, None)
        if pins:
            pool.free_blocks(reversed(pins))
        if config is not None and self.enabled and self.private_from_start(config):
            self.private.add(request_id)
