"""Scheduler side: decides how many tokens each request keeps and gives the freed pages back.

Per request the scheduler tracks ``evicted`` = logical tokens computed - tokens physically cached.
Everything vLLM keeps logical (``num_computed_tokens``, the max_model_len cap, positions) stays
logical; only page arithmetic sees the physical length.

Each step:
1. before vLLM schedules, the pages freed by last step's eviction are returned to the pool, so they
   are usable at once;
2. vLLM schedules as usual (its page allocation sees physical lengths: engine/kv_spec.py, on vLLM's
   KV-cache spec registry);
3. for every scheduled request with eviction on, the scheduler applies the shared rule
   (``vllm_evict.schedule.eviction_target``) and attaches the plan to the SchedulerOutput; the workers
   evict right after each layer's attention of this step, keeping exactly that many tokens per head.

Async scheduling (vLLM's default on GPU): ``EvictAsyncScheduler`` is this scheduler over vLLM's
``AsyncScheduler``, picked the way vLLM picks its own (``scheduler_class``, by ``async_scheduling``;
plugin.py). It schedules step n+1 while the workers run step n, before step n's output is back; nothing
here waits for that output. Each request's logical count (``num_computed_tokens``) advances when a step is
scheduled, and the plan's kept counts are the scheduler's own decision, so step n+1's plan is built on
step n's compaction exactly as when the steps alternate. The pages step n's compaction frees are handed
back at the start of step n+1's ``schedule()`` and can only be written by step n+1 or later: the workers
run the steps in order, so step n's compaction (and every read and write of those pages in step n) comes
first. A request that finishes in step n may already be in step n+1, whose output vLLM then drops; its
pages go back when vLLM frees the request.

Request intake. ``add_request`` is where the engine first sees a request: its eviction settings are
resolved again (``vllm_evict.request_settings``; a request from this plugin's front end carries them in
canonical form, one from elsewhere, e.g. a raw EngineCoreRequest, may carry the raw keys). A bad one is
refused without raising (an exception here would kill the engine core): vLLM finishes it at once with
``FINISHED_ERROR``, and the next ``update_from_output`` sends its client an output with finish reason
``error`` whose ``kv_transfer_params["kv_eviction_refused"]`` says why.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from vllm_evict.config import EvictionConfig
from vllm_evict.engine.elastic import ElasticCompressor
from vllm_evict.engine.kv_spec import EvictingAttentionManager
from vllm_evict.engine.plan import PLAN_ATTR, EvictionPlan
from vllm_evict.engine.prefix_sharing import PrefixSharing
from vllm_evict.engine.window_lender import WindowPageLender
from vllm_evict.engine.stats import EvictionAccounting, EvictSchedulerStats, with_report, worker_report_of
from vllm_evict.request_settings import RequestRefused, carry, has_settings, resolve, server_settings
from vllm_evict.policies.base import Phase, Policy
from vllm_evict.schedule import eviction_target, phase_of, request_bound, works_in_layers
from vllm_evict.stats import REFUSED_KEY

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it


def server_eviction_mapping(vllm_config: Any) -> dict[str, Any] | None:
    """The server-wide eviction settings exactly as the user gave them (additional_config)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    mapping = extra.get("kv_eviction")
    return dict(mapping) if mapping else None


class EvictScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_eviction = server_eviction_mapping(self.vllm_config)
        self.server_settings = server_settings(self.server_eviction)
        self.eviction_configs: dict[str, EvictionConfig | None] = {}
        self.refused: dict[str, tuple[int, str]] = {}  # request id -> (client index, why), until reported
        self.pending_keep: dict[str, int] = {}  # request id -> tokens kept by last step's eviction
        self.policy_of: dict[str, Policy] = {}  # request id -> its policy (per-layer work of a step)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1:
            raise ValueError("KV eviction supports models with one KV-cache group (full attention in every "
                             f"layer); this model has {len(managers)} groups")
        if not isinstance(managers[0], EvictingAttentionManager):
            raise ValueError(f"KV eviction needs its page manager for the KV-cache group, got "
                             f"{type(managers[0]).__name__}: the workers must report EvictingAttentionSpec "
                             "(run the model with vllm_evict's worker, which --kv-eviction selects)")
        self.attention_manager: EvictingAttentionManager = managers[0]
        self.evicted = self.attention_manager.evicted  # request id -> logical - physical tokens (engine/kv_spec.py)
        self.page_size = self.attention_manager.block_size
        self.kv_cache_manager.__class__ = _evicting_manager_class(type(self.kv_cache_manager))
        self.kv_cache_manager.eviction = self
        self.elastic = ElasticCompressor(self)
        self.window_pages = WindowPageLender(self)
        self.sharing = PrefixSharing(self)  # prefix caching: pages shared until a request first writes
        self.accounting = EvictionAccounting(self.log_stats)  # metrics and per-request reports
        self.stats_client = 0  # the front end that got the last SchedulerStats
        # vLLM's own "Using custom scheduler class" line is not printed (plugin.py picks the class), so this
        # line is what shows an operator (and the server tests) that the engine core schedules with eviction
        logger.info("vllm_evict: scheduler %s.%s", type(self).__module__, type(self).__qualname__)

    # ---- per-request configuration ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        extra = params.extra_args if params is not None else None
        try:
            resolved = resolve(self.server_settings, extra, max_model_len=self.vllm_config.model_config.max_model_len)
        except RequestRefused as err:
            self._refuse(request, str(err))
            return
        if params is not None and has_settings(extra):
            params.extra_args = carry(extra, resolved)  # the worker reads only the canonical form
        config = resolved.config
        self.eviction_configs[request.request_id] = config
        self.accounting.add(request.request_id, config, stop_strings=bool(params is not None and params.stop))
        self.sharing.admit(request, config)
        super().add_request(request)

    def _refuse(self, request: Request, message: str) -> None:
        """Finish a request with bad settings at once, as vLLM finishes one it cannot serve (an error
        output, reported by ``update_from_output``), so the engine core goes on."""
        super().add_request(request)
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self.refused[request.request_id] = (request.client_index, message)
        self.accounting.refused()
        logger.warning("vllm_evict: refused request %s: %s", request.request_id, message)

    def _report_refused(self, outputs: dict[int, Any]) -> None:
        for request_id, (client, message) in self.refused.items():
            output = EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                                      kv_transfer_params={REFUSED_KEY: message})
            eco = outputs.get(client)
            if eco is None:  # (vLLM has put the id in its finished set for this client, where it keeps one)
                eco = outputs[client] = EngineCoreOutputs()
            eco.outputs.append(output)
        self.refused.clear()

    def config_of(self, request_id: str) -> EvictionConfig | None:
        return self.eviction_configs.get(request_id)

    def slack_of(self, config: EvictionConfig) -> int:
        return config.slack_for(self.page_size)

    def admission_tokens(self, request: Request) -> int:
        """Tokens ``request`` will hold while computing the tokens it has now (prompt, plus outputs
        replayed after a preemption): vLLM's full-sequence admission reserves pages for
        ``num_tokens`` tokens, this is the same reservation under eviction (never more)."""
        config = self.config_of(request.request_id)
        replayed = request.num_tokens - request.num_prompt_tokens
        tokens = request_bound(config, prompt_len=request.num_prompt_tokens, max_new_tokens=replayed,
                               replayed=replayed, page_size=self.page_size,
                               chunk=self.scheduler_config.max_num_batched_tokens)
        return min(tokens, self.vllm_config.model_config.max_model_len)

    # ---- the step -----------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._free_evicted_pages()
        self.sharing.begin_step()
        self.elastic.begin_step()
        self.window_pages.begin_step()
        output = super().schedule(*args, **kwargs)
        self._forget_gone_requests()
        plan = EvictionPlan(layer_work=False)
        self.elastic.finish_step(output, plan)
        for request_id, num_new in output.num_scheduled_tokens.items():
            config = self.config_of(request_id)
            if config is None:
                continue
            request = self.requests[request_id]
            tokens_before = request.num_computed_tokens - num_new  # vLLM has already advanced it
            phys_after = tokens_before - self.evicted.get(request_id, 0) + num_new
            self.accounting.scheduled(request_id, phys_after)
            if config.elastic:  # elastic requests evict only when the pool is short; their rows work every step
                plan.layer_work = True
                continue
            phase = phase_of(tokens_before, num_new, request.num_prompt_tokens)
            slack = self.slack_of(config)
            self.window_pages.scheduled(request_id, config, decode=phase is Phase.DECODE, phys_after=phys_after,
                                        logical_after=tokens_before + num_new, slack=slack)
            keep = eviction_target(phys_after=phys_after, phase=phase, budget=config.budget,
                                   schedule=config.schedule, slack=slack)
            if keep is not None:
                plan.keep[request_id] = keep
                plan.cached[request_id] = phys_after
                self.pending_keep[request_id] = keep
                self.accounting.evicted(request_id, phys_after - keep)
                plan.layer_work = True
            elif not plan.layer_work:  # once one request has per-layer work, the step leaves full graphs
                plan.layer_work = self._works_in_layers(request, config, tokens_before, num_new, phys_after)
        self.window_pages.finish_step(plan)
        if self.sharing.now:
            self.sharing.finish_step(output.num_scheduled_tokens, plan)
        plan.layer_work = plan.layer_work or bool(plan.copies)
        self.accounting.end_step()
        setattr(output, PLAN_ATTR, plan)
        return output

    def _works_in_layers(self, request: Request, config: EvictionConfig, tokens_before: int, num_new: int,
                         phys_after: int) -> bool:
        policy = self.policy_of.get(request.request_id)
        if policy is None:
            policy = self.policy_of[request.request_id] = self.window_pages.policy_for(config)
        return works_in_layers(policy, config, tokens_before=tokens_before, num_new=num_new,
                               prompt_len=request.num_prompt_tokens, phys_before=phys_after - num_new,
                               page_size=self.page_size)

    def _free_evicted_pages(self) -> None:
        """Give back the trailing pages of requests the workers compacted during the last step."""
        for request_id, keep in self.pending_keep.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted: vLLM already freed every page
            freed = self.attention_manager.release_tail(request_id, cdiv(keep, self.page_size),
                                                        evicted=request.num_computed_tokens - keep)
            self.accounting.freed(request_id, freed)
        self.pending_keep.clear()

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self.window_pages.forget(request.request_id)
        self.sharing.forget(request.request_id, self.config_of(request.request_id))
        # Recompute-preemption drops every page (and the evicted count, engine/kv_spec.py) and restarts
        # from token 0.
        self.pending_keep.pop(request.request_id, None)
        self.elastic.compressions.pop(request.request_id, None)
        self.elastic.allocated_now.pop(request.request_id, None)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any, *args: Any,
                           **kwargs: Any) -> Any:
        self.accounting.observe_worker(worker_report_of(model_runner_output))  # before make_stats runs
        outputs = super().update_from_output(scheduler_output, model_runner_output, *args, **kwargs)
        if self.refused:
            self._report_refused(outputs)
        self._keep_stats_in_order(outputs)
        self._report_unfinished(outputs)
        self._forget_gone_requests()
        return outputs

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        finished = super().finish_requests(*args, **kwargs)
        self._forget_gone_requests()
        return finished

    def _forget_gone_requests(self) -> None:
        for request_id in [r for r in self.eviction_configs if r not in self.requests]:
            self.eviction_configs.pop(request_id, None)
            self.evicted.pop(request_id, None)
            self.pending_keep.pop(request_id, None)
            self.policy_of.pop(request_id, None)
            self.sharing.forget(request_id)

    def num_cached_tokens(self, request_id: str) -> int:
        """Tokens physically cached for a request (tests and metrics)."""
        request = self.requests[request_id]
        return request.num_computed_tokens - self.evicted.get(request_id, 0)

    # ---- eviction stats: per-request reports (kv_transfer_params) and SchedulerStats -------------
    def tokens_in_cache(self, request: Request) -> int:
        """Tokens physically cached now, i.e. after this step's compaction (its pages go back next step)."""
        keep = self.pending_keep.get(request.request_id)
        return keep if keep is not None else request.num_computed_tokens - self.evicted.get(request.request_id, 0)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        # vLLM puts what this returns in the finished request's EngineCoreOutput.kv_transfer_params.
        report = self.accounting.finish(request.request_id, self.tokens_in_cache(request))
        self.window_pages.forget(request.request_id)
        kv_transfer_params, *rest = super()._free_request(request, *args, **kwargs)
        return (with_report(kv_transfer_params, report), *rest)

    def _keep_stats_in_order(self, outputs: dict[int, Any]) -> None:
        """Send the stats of a step without outputs to the front end that got the previous stats.

        vLLM sends them to front end 0 then; with several API servers, the last step of a request (the
        worker not yet told it finished) goes to that request's front end, the step after it (the worker
        told) to front end 0, and the two processes may record them in either order: the gauges would
        stay at the older values while the server is idle (Prometheus keeps the most recent write)."""
        carrier = next((index for index, eco in outputs.items() if eco.scheduler_stats is not None), None)
        if carrier is None:
            return
        eco = outputs[carrier]
        stats_only = carrier == 0 and len(outputs) == 1 and not eco.outputs and not eco.finished_requests
        if stats_only and self.stats_client != 0:
            outputs[self.stats_client] = outputs.pop(0)
        else:
            self.stats_client = carrier

    def _report_unfinished(self, outputs: dict[int, Any]) -> None:
        """Reports on the outputs of unfinished requests that want one on every output."""
        if not self.accounting.every_output:
            return
        for engine_core_outputs in outputs.values():
            for out in engine_core_outputs.outputs:
                request = self.requests.get(out.request_id)
                wanted = out.finish_reason is None and out.request_id in self.accounting.every_output
                if wanted and request is not None:
                    report = self.accounting.report(out.request_id, self.tokens_in_cache(request))
                    out.kv_transfer_params = with_report(out.kv_transfer_params, report)

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        stats = super().make_stats(*args, **kwargs)
        if stats is None:
            return None
        self._forget_gone_requests()
        tracked = {*self.eviction_configs, *self.evicted, *self.pending_keep, *self.accounting.requests,
                   *self.accounting.every_output}
        step = self.accounting.take_step_stats(
            tokens_cached=sum(self.tokens_in_cache(r) for r in self.running),
            tokens_logical=sum(r.num_computed_tokens for r in self.running), scheduler_requests=len(tracked))
        return EvictSchedulerStats.extend(stats, step)


class EvictAsyncScheduler(EvictScheduler, AsyncScheduler):
    """``EvictScheduler`` over vLLM's ``AsyncScheduler``: one step in flight (see the module docstring)."""


def scheduler_class(async_scheduling: bool) -> type[EvictScheduler]:
    """The eviction scheduler for an engine with or without async scheduling, as vLLM chooses between its
    ``Scheduler`` and ``AsyncScheduler`` (``SchedulerConfig.get_scheduler_cls``)."""
    return EvictAsyncScheduler if async_scheduling else EvictScheduler


_MANAGER_CLASSES: dict[type, type] = {}


def _evicting_manager_class(base: type[KVCacheManager]) -> type[KVCacheManager]:
    if base not in _MANAGER_CLASSES:
        _MANAGER_CLASSES[base] = type("Evicting" + base.__name__, (EvictKVCacheManagerMixin, base), {})
    return _MANAGER_CLASSES[base]


class EvictKVCacheManagerMixin:
    """Admission under eviction, and prefix caching kept off every page eviction writes
    (engine/prefix_sharing.py). The page arithmetic itself (physical lengths) is the registry's manager's
    (engine/kv_spec.py); a request that has evicted hashes nothing (``delay_cache_blocks``).
    The full-sequence admission check (``full_sequence_must_fit``) is replaced by the same check sized
    to what the request will hold under eviction, with vLLM's watermark; ``reserved_blocks`` still
    applies to the allocation itself, which vLLM makes after that check.
    """

    eviction: EvictScheduler

    def allocate_slots(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        scheduler = self.eviction
        config = scheduler.config_of(request.request_id)
        sharing = scheduler.sharing
        privatize = False
        if config is not None and sharing.enabled:
            if sharing.hashes(request.request_id):
                hits = kwargs.get("num_new_computed_tokens", args[0] if args else 0)
                sharing.found(request, hits)
                evicted = scheduler.evicted.get(request.request_id, 0)
                privatize = sharing.changes(request, config, num_new_tokens, hits, evicted)
                if privatize:
                    hit_blocks = kwargs.get("new_computed_blocks", args[1] if len(args) > 1 else None)
                    new_hit_blocks = len(hit_blocks.blocks[0]) if hit_blocks is not None else 0
                    if not sharing.room_for(request, self, num_new_tokens, hits, new_hit_blocks,
                                            kwargs.get("num_lookahead_tokens", 0), evicted):
                        return None
            else:
                kwargs = {**kwargs, "delay_cache_blocks": True}
        admission = kwargs.get("full_sequence_must_fit") and config is not None
        result = self._allocate_physical(request, num_new_tokens, *args, **kwargs)
        if result is None and scheduler.window_pages.lent:  # lent window pages go back before anything else
            scheduler.window_pages.reclaim()
            result = self._allocate_physical(request, num_new_tokens, *args, **kwargs)
        lookahead = kwargs.get("num_lookahead_tokens", 0)
        elastic = scheduler.elastic
        if result is None and elastic.any_elastic():
            wanted = elastic.deficit(self, request, num_new_tokens, lookahead,
                                     scheduler.admission_tokens(request) if admission else None)
            admitting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if elastic.free_pages(wanted, admitting) > 0:
                result = self._allocate_physical(request, num_new_tokens, *args, **kwargs)
        if result is not None:
            elastic.note_allocation(request.request_id, num_new_tokens + lookahead)
            if privatize:
                sharing.privatize(request, self)
        return result

    def get_computed_blocks(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        """vLLM's prefix-cache lookup, cut at the request's ``PrefixSharing.hit_limit`` (whole pages): the
        (blocks, tokens, ...) tuple vLLM returns, with fewer blocks and tokens."""
        result = super().get_computed_blocks(request, *args, **kwargs)  # type: ignore[misc]
        blocks, hits = result[0], result[1]
        limit = self.eviction.sharing.hit_limit(request) if hits else None
        if limit is None or hits <= limit:
            return result
        pages = limit // self.eviction.page_size
        kept = self.create_kv_cache_blocks(tuple(list(group[:pages]) for group in blocks.blocks))  # type: ignore[attr-defined]
        return (kept, pages * self.eviction.page_size, *result[2:])

    def cache_blocks(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if self.eviction.sharing.hashes(request.request_id):
            super().cache_blocks(request, *args, **kwargs)  # type: ignore[misc]

    def _allocate_physical(self, request: Request, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        scheduler = self.eviction
        if kwargs.get("full_sequence_must_fit") and scheduler.config_of(request.request_id) is not None:
            kwargs = {**kwargs, "full_sequence_must_fit": False}
            if not self._bounded_sequence_fits(request, kwargs.get("has_scheduled_reqs", True)):
                return None
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)  # type: ignore[misc]

    def _bounded_sequence_fits(self, request: Request, has_scheduled_reqs: bool) -> bool:
        scheduler = self.eviction
        held = len(scheduler.attention_manager.req_to_blocks.get(request.request_id, ()))
        needed = max(cdiv(scheduler.admission_tokens(request), scheduler.page_size) - held, 0)
        # As in vLLM: the watermark holds back pages from waiting and preempted requests, and only
        # while something else is running.
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks  # type: ignore[attr-defined]
        return needed + watermark <= self.block_pool.get_num_free_blocks()  # type: ignore[attr-defined]
