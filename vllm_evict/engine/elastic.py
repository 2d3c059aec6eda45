"""Elastic eviction, scheduler side: compress running requests when the KV pool runs short, instead of
preempting them.

In elastic mode (``{"mode": "elastic"}``) a request's budget is a floor, not a ceiling: it keeps its
whole cache while the pool has room. When vLLM cannot allocate the pages a step needs (for a running
request's next tokens, or to admit a waiting one), the scheduler first takes pages from running
elastic requests that hold more than their floor, and only when none is left does vLLM preempt as
usual. The rule, applied until the allocation succeeds:

* victims are the running elastic requests with cached tokens above their floor, the largest excess
  first (the requester itself included: a prompt larger than the pool compresses itself between
  chunks);
* a victim gives up only the pages the allocation still lacks, never going below its floor, always
  keeps room for the tokens it is computing in this step, and is left ``slack`` tokens of room in its
  last page (so that it is not compressed again on its very next step);
* to admit a waiting request, victims are compressed only down to floor + slack (their decode
  headroom), and only if that frees enough pages to admit it: admission never squeezes running
  requests for nothing, nor so far that their next tokens would need a preemption.

A victim's pages are freed at once and may go to another request in the same step: the workers
compact the victim before the forward (``EvictionPlan.compress``), reading the cache as the previous
step left it, and scoring with the latest queries of its observation window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.utils.math_utils import cdiv
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm_evict.engine.scheduler import EvictScheduler


@dataclass
class Compression:
    cached_before: int  # tokens the victim had cached before this step's compressions
    keep: int  # tokens it keeps


class ElasticCompressor:
    def __init__(self, scheduler: "EvictScheduler") -> None:
        self.scheduler = scheduler
        self.compressions: dict[str, Compression] = {}  # this step's, by request id
        self.allocated_now: dict[str, int] = {}  # request id -> tokens given slots in this step

    def begin_step(self) -> None:
        self.compressions.clear()
        self.allocated_now.clear()

    def note_allocation(self, request_id: str, tokens: int) -> None:
        self.allocated_now[request_id] = tokens

    def any_elastic(self) -> bool:
        return any(c is not None and c.elastic for c in self.scheduler.eviction_configs.values())

    # ---- victims ------------------------------------------------------------------------------
    def _excess(self, request: Request, margin: bool) -> int:
        """Tokens ``request`` could give up (0 if it is not an elastic running request)."""
        config = self.scheduler.config_of(request.request_id)
        if config is None or not config.elastic or request.status != RequestStatus.RUNNING:
            return 0
        floor = config.budget + (self.scheduler.slack_of(config) if margin else 0)
        return max(0, self.scheduler.num_cached_tokens(request.request_id) - floor)

    def _floor(self, request_id: str, admitting: bool) -> int:
        config = self.scheduler.config_of(request_id)
        return config.budget + (self.scheduler.slack_of(config) if admitting else 0)

    def _freeable(self, request: Request, admitting: bool) -> int:
        """Pages ``request`` could give back without going below its floor."""
        scheduler = self.scheduler
        held = len(scheduler.attention_manager.req_to_blocks[request.request_id])
        floor = self._floor(request.request_id, admitting) + self.allocated_now.get(request.request_id, 0)
        return max(0, held - cdiv(floor, scheduler.page_size))

    def free_pages(self, wanted: int, admitting: bool) -> int:
        """Compress victims until ``wanted`` pages are free or none is left; returns the pages freed.
        To admit a request, nothing is compressed unless it frees enough."""
        scheduler = self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        candidates = sorted((r for r in scheduler.running if self._excess(r, admitting) > 0),
                            key=lambda r: self._excess(r, admitting), reverse=True)
        missing = wanted - pool.get_num_free_blocks()
        if missing <= 0 or (admitting and sum(self._freeable(r, admitting) for r in candidates) < missing):
            return 0
        freed = 0
        for victim in candidates:
            missing = wanted - pool.get_num_free_blocks()
            if missing <= 0:
                break
            freed += self._compress(victim, missing, admitting)
        return freed

    def _compress(self, victim: Request, pages: int, admitting: bool) -> int:
        """Free up to ``pages`` of ``victim``'s trailing pages by compressing it; returns the pages freed."""
        scheduler = self.scheduler
        request_id = victim.request_id
        config = scheduler.config_of(request_id)
        page = scheduler.page_size
        blocks = scheduler.attention_manager.req_to_blocks[request_id]
        cached = scheduler.num_cached_tokens(request_id)
        new_tokens = self.allocated_now.get(request_id, 0)  # slots it was already given in this step
        floor = self._floor(request_id, admitting)
        held = len(blocks)
        keep_pages = max(held - pages, cdiv(floor + new_tokens, page))
        # Room for ``slack`` more tokens in the pages it keeps, so it is not compressed again at once.
        keep = min(cached, keep_pages * page - new_tokens - scheduler.slack_of(config))
        keep = max(keep, floor)
        if keep >= cached:
            return 0
        freed = scheduler.attention_manager.release_tail(
            request_id, cdiv(keep + new_tokens, page), evicted=scheduler.evicted.get(request_id, 0) + cached - keep)
        scheduler.accounting.compressed(request_id, cached - keep, freed)
        before = self.compressions.get(request_id)
        self.compressions[request_id] = Compression(
            cached_before=before.cached_before if before is not None else cached, keep=keep)
        return freed

    def deficit(self, manager: Any, request: Request, num_new_tokens: int, lookahead: int,
                admission_tokens: int | None) -> int:
        """Pages the failed allocation lacked (at least one: vLLM also holds back reserved pages)."""
        scheduler = self.scheduler
        held = len(scheduler.attention_manager.req_to_blocks.get(request.request_id, ()))
        if admission_tokens is not None:
            needed = cdiv(admission_tokens, scheduler.page_size) + manager.watermark_blocks
        else:
            cached = request.num_computed_tokens - scheduler.evicted.get(request.request_id, 0)
            needed = cdiv(cached + num_new_tokens + lookahead, scheduler.page_size)
        return max(needed - held, 1)

    # ---- the plan -------------------------------------------------------------------------------
    def finish_step(self, output: Any, plan: Any) -> None:
        """Hand this step's compressions to the workers, with each victim's page list after them.

        vLLM lists the pages it allocated to a request in this step as the request's new block ids;
        a victim may have given some of them back, so its whole list is sent instead."""
        scheduler = self.scheduler
        gone = set(output.preempted_req_ids or ())
        cached_reqs = output.scheduled_cached_reqs
        index = {request_id: i for i, request_id in enumerate(cached_reqs.req_ids)}
        for request_id, compression in self.compressions.items():
            request = scheduler.requests.get(request_id)
            if request_id in gone or request is None or request.status != RequestStatus.RUNNING:
                continue
            blocks = scheduler.attention_manager.req_to_blocks[request_id]
            plan.compress[request_id] = compression.keep
            plan.compress_cached[request_id] = compression.cached_before
            plan.compress_pages[request_id] = [b.block_id for b in blocks]
            i = index.get(request_id)
            if i is not None:
                cached_reqs.new_block_ids[i] = None
