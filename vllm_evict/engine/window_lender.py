"""Window pages, scheduler side: lend a request pages of the KV pool while it is inside a decode window,
and take them back (engine/window_pages.py says what the pages hold and why).

Per step, for each scheduled fixed-mode request of a method that reads a window at its decode
evictions: if this step's query belongs to the window of its next decode eviction (the same rule the
workers follow, ``vllm_evict.schedule.eviction_target`` and the policy's ``window_size``), it needs pages;
otherwise it gives back any it holds. Lending never takes what vLLM would use instead:

* pages are lent only from the free pool, above vLLM's watermark, and not while a request waits for
  admission that a free seat would let in;
* when an allocation fails (a running request's next tokens, or an admission), every loan is taken back
  before vLLM may preempt anything (``reclaim``), and nothing is lent again in that step. The workers
  first add the mass of the queries those pages hold to the requests' window state
  (``EvictionPlan.window_returned``), before this step's forward writes into the pages.

A request that gets no pages accumulates its window's mass as its queries arrive: the same tokens are
kept either way. ``VLLM_EVICT_WINDOW_PAGES=0`` turns lending off (every window accumulates); so does an fp8
KV cache, whose slots are too narrow for a query in the model's dtype.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_evict.engine.window_pages import pages_for_window
from vllm_evict.guards import fp8_storage_dtype
from vllm_evict.policies.base import Policy

if TYPE_CHECKING:
    from vllm_evict.config import EvictionConfig
    from vllm_evict.engine.plan import EvictionPlan
    from vllm_evict.engine.scheduler import EvictScheduler

ENV = "VLLM_EVICT_WINDOW_PAGES"


def query_group(model_config: Any) -> int:
    """Query heads per KV head in the model (an upper bound of any tensor-parallel rank's)."""
    kv_heads = max(model_config.get_total_num_kv_heads(), 1)
    query_heads = model_config.hf_text_config.num_attention_heads
    return max(-(-query_heads // kv_heads), 1)


class WindowPageLender:
    def __init__(self, scheduler: "EvictScheduler") -> None:
        self.scheduler = scheduler
        # Lent pages hold queries in the model's dtype in K/V slots: an fp8 cache's slots are too narrow.
        fp8 = fp8_storage_dtype(scheduler.vllm_config.cache_config.cache_dtype)
        self.enabled = os.environ.get(ENV, "1") != "0" and fp8 is None
        self.group = query_group(scheduler.vllm_config.model_config)
        settings = scheduler.server_settings
        self.window_cap = settings[1].max_window if settings is not None else None
        self.lent: dict[str, list[Any]] = {}  # request id -> its lent KVCacheBlocks
        self.lent_now: dict[str, list[int]] = {}  # this step's new loans: request id -> page ids
        self.returned: list[str] = []  # this step's returns
        # This step's decoding requests of window methods: (request id, policy, physical and logical length
        # after the step, budget, slack), decided together in ``finish_step``.
        self.decoding: list[tuple[str, Policy, int, int, int, int]] = []
        self.policy_of: dict[str, Policy] = {}  # the policy of each request seen decoding (until it ends)
        self.reclaimed = False  # loans were taken back in this step: lend nothing more in it
        self.loans = 0  # loans made so far (tests, logs)
        self.reclaims = 0  # times an allocation took every loan back
        self._policies: dict[str, Policy] = {}

    def begin_step(self) -> None:
        self.lent_now, self.returned, self.reclaimed, self.decoding = {}, [], False, []

    def pages_lent(self) -> int:
        return sum(len(blocks) for blocks in self.lent.values())

    # ---- the rule ---------------------------------------------------------------------------------
    def policy_for(self, config: "EvictionConfig") -> Policy:
        """The policy of ``config`` (built once per distinct config, bounded)."""
        key = str(config)
        policy = self._policies.get(key)
        if policy is None:
            if len(self._policies) > 4 * self.scheduler.max_num_running_reqs:  # bounded: configs come from requests
                self._policies.clear()
            policy = self._policies[key] = config.build_policy(window_cap=self.window_cap)
        return policy

    def scheduled(self, request_id: str, config: "EvictionConfig", *, decode: bool, phys_after: int,
                  logical_after: int, slack: int) -> None:
        """A fixed-mode request scheduled in this step (after vLLM allocated its slots): noted, and decided
        with the others in ``finish_step``."""
        policy = self.policy_of.get(request_id) if decode and self.enabled else None
        if policy is None and decode and self.enabled:
            policy = self.policy_of[request_id] = self.policy_for(config)
        if policy is not None and policy.accumulates_window and policy.window_in_decode:
            self.decoding.append((request_id, policy, phys_after, logical_after, config.budget, slack))
        elif request_id in self.lent:
            self._give_back(request_id)

    def _decide(self) -> None:
        """Lend or take back pages for this step's decoding requests: a request needs them while its query
        of the step belongs to the window of its next decode eviction (``eviction_target``: at budget +
        slack), of the policy's ``window_size`` there; the widths are computed per policy, batched."""
        by_policy: dict[int, list[int]] = {}
        for i, entry in enumerate(self.decoding):
            by_policy.setdefault(id(entry[1]), []).append(i)
        for members in by_policy.values():
            rows = [self.decoding[i] for i in members]
            phys, logical, budget, slack = (np.array([r[k] for r in rows], dtype=np.int64) for k in range(2, 6))
            end = budget + slack  # the next decode eviction
            width = rows[0][1].window_size(logical + np.maximum(end - phys, 0), budget)
            # A one-query window is read in the step that computes its query: nothing to keep.
            needs = (width > 1) & (phys > end - width)
            for (request_id, *_), need, w in zip(rows, needs, width):
                held = request_id in self.lent
                if need and not held:
                    self._lend(request_id, pages_for_window(int(w), self.group, self.scheduler.page_size))
                elif not need and held:
                    self._give_back(request_id)

    def _can_lend(self, pages: int) -> bool:
        scheduler = self.scheduler
        if self.reclaimed:
            return False
        if len(scheduler.waiting) and len(scheduler.running) < scheduler.max_num_running_reqs:
            return False  # a waiting request may be admitted as soon as pages free up: leave them to it
        manager = scheduler.kv_cache_manager
        return manager.block_pool.get_num_free_blocks() - pages >= getattr(manager, "watermark_blocks", 0)

    def _lend(self, request_id: str, pages: int) -> None:
        if not self._can_lend(pages):
            return
        blocks = self.scheduler.kv_cache_manager.block_pool.get_new_blocks(pages)
        self.lent[request_id] = blocks
        self.lent_now[request_id] = [b.block_id for b in blocks]
        self.loans += 1

    def _give_back(self, request_id: str) -> None:
        blocks = self.lent.pop(request_id)
        self.scheduler.kv_cache_manager.block_pool.free_blocks(blocks)
        if self.lent_now.pop(request_id, None) is None:
            self.returned.append(request_id)

    # ---- memory pressure, and requests that end ---------------------------------------------------
    def reclaim(self) -> int:
        """Take every loan back (an allocation failed); returns the pages freed."""
        freed = self.pages_lent()
        for request_id in list(self.lent):
            self._give_back(request_id)
        self.reclaimed = True
        self.reclaims += 1
        return freed

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its pages go back; its worker row is dropped anyway."""
        blocks = self.lent.pop(request_id, None)
        if blocks is not None:
            self.scheduler.kv_cache_manager.block_pool.free_blocks(blocks)
        self.lent_now.pop(request_id, None)
        self.policy_of.pop(request_id, None)

    def finish_step(self, plan: "EvictionPlan") -> None:
        if self.decoding:
            self._decide()
        plan.window_pages = dict(self.lent_now)
        plan.window_returned = list(self.returned)
