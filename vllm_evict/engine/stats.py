"""Eviction accounting in the engine core, and the two ways it leaves the engine core.

- Per request: ``EvictionAccounting`` counts what eviction did to each request; the scheduler puts the
  report (``vllm_evict.stats.RequestEvictionStats``) in the request's ``kv_transfer_params``.
- Per step: ``EvictionStepStats`` rides on the scheduler's ``SchedulerStats`` (``make_stats``) as the extra
  field of ``EvictSchedulerStats``; the front end's stat logger (``vllm_evict.metrics``) turns it into
  Prometheus metrics.

Why the wire type is widened: vLLM decodes ``EngineCoreOutputs`` with a typed msgspec decoder, so an
attribute the scheduler merely sets on ``SchedulerStats`` is dropped between the engine-core process and
the API server. ``widen_scheduler_stats_wire_type()`` (called by ``plugin.register()``, before any decoder
exists in the process: msgspec caches type information) declares ``EngineCoreOutputs.scheduler_stats`` as
the subclass, whose extra field then survives. A plain ``SchedulerStats`` still decodes (the field is None).

The worker's part (time spent evicting, requests it holds state for) reaches the scheduler as an
attribute of the step's ``ModelRunnerOutput``, which is pickled, not msgspec-decoded, between processes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from vllm.v1.metrics.stats import SchedulerStats

from vllm_evict.config import EvictionConfig
from vllm_evict.stats import KEY, POLICY_NONE, RequestEvictionStats


# ---- per step: engine core -> front end ----------------------------------------------------------
@dataclass
class EvictionStepStats:
    """Eviction since the previous stats (counters) and at this step (gauges)."""

    tokens_evicted: int = 0
    pages_freed: int = 0
    eviction_steps: int = 0  # engine steps in which at least one request evicted (or was compressed)
    elastic_compressions: int = 0  # running elastic requests compressed to make room (instead of preempted)
    refused_requests: int = 0  # requests refused at the engine's intake for their eviction settings
    prefix_copied_pages: int = 0  # hashed or shared pages copied when a request first wrote (prefix caching)
    prefix_uncached_pages: int = 0  # hashed pages taken out of the prefix cache to be written in place
    finished_requests: dict[str, int] = field(default_factory=dict)  # policy -> requests that finished
    step_seconds: list[float] = field(default_factory=list)  # worker time in eviction, one entry per step
    tokens_cached: int = 0  # tokens physically cached by the running requests
    tokens_logical: int = 0  # logical tokens (computed so far) of the running requests
    scheduler_requests: int = 0  # requests the scheduler holds eviction state for
    worker_requests: int = 0  # requests the worker (rank 0) holds eviction state for


@dataclass
class EvictSchedulerStats(SchedulerStats):
    kv_eviction: EvictionStepStats | None = None

    @classmethod
    def extend(cls, base: SchedulerStats, kv_eviction: EvictionStepStats) -> "EvictSchedulerStats":
        values = {f.name: getattr(base, f.name) for f in fields(SchedulerStats) if f.init}
        return cls(**values, kv_eviction=kv_eviction)


def widen_scheduler_stats_wire_type() -> None:
    from vllm.v1.engine import EngineCoreOutputs

    EngineCoreOutputs.__annotations__["scheduler_stats"] = EvictSchedulerStats | None


# ---- per step: worker -> scheduler ---------------------------------------------------------------
WORKER_REPORT_ATTR = "kv_eviction_report"  # attribute set on the step's ModelRunnerOutput


@dataclass
class WorkerReport:
    # Time in eviction of each step whose time the worker read since its last report (on CUDA a step or two
    # late: engine/step_timer.py); steps without eviction work are left out.
    eviction_seconds: tuple[float, ...]
    tracked_requests: int  # requests the worker holds eviction state for


def attach_worker_report(output: Any, report: WorkerReport) -> Any:
    """Set the report on a ModelRunnerOutput (returned as is when it is None or not a step output).
    An ``AsyncModelRunnerOutput`` (Model Runner V2's output, and the V1 runner's with async scheduling)
    makes the step's ModelRunnerOutput when the executor asks for it (``get_output``, which waits for the
    device): the report is set on what it makes."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput

    if isinstance(output, AsyncModelRunnerOutput):
        get_output = output.get_output

        def get_output_with_report() -> Any:
            return attach_worker_report(get_output(), report)

        output.get_output = get_output_with_report  # type: ignore[method-assign]
        return output
    if output is None or not hasattr(output, "req_id_to_index"):
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)  # a shared constant: never mutate it
    setattr(output, WORKER_REPORT_ATTR, report)
    return output


def worker_report_of(model_runner_output: Any) -> WorkerReport | None:
    return getattr(model_runner_output, WORKER_REPORT_ATTR, None)


# ---- scheduler-side accounting -------------------------------------------------------------------
@dataclass
class RequestAccount:
    policy: str
    budget: int | None
    tokens_evicted: int = 0
    pages_freed: int = 0
    peak_tokens_cached: int = 0


class EvictionAccounting:
    """What eviction did, per request and since the last stats. Owned by the scheduler, which tells it
    about requests (``add``, ``finish``), each step's scheduled tokens (``scheduled``), evictions
    (``evicted``, then ``end_step``), elastic compressions (``compressed``) and freed pages (``freed``)."""

    def __init__(self, log_stats: bool) -> None:
        self.log_stats = log_stats
        self.requests: dict[str, RequestAccount] = {}
        self.every_output: set[str] = set()  # requests reported on every output, not only on the last
        self.step = EvictionStepStats()
        self.worker_requests = 0
        self._evicted_in_step = False

    def add(self, request_id: str, config: EvictionConfig | None, stop_strings: bool) -> None:
        self.requests[request_id] = RequestAccount(policy=config.policy if config else POLICY_NONE,
                                                   budget=config.budget if config else None)
        if stop_strings:
            # A stop string ends the request in the front end (the detokenizer), at an output the engine
            # core does not know to be the last one: such a request is reported on every output.
            self.every_output.add(request_id)

    def scheduled(self, request_id: str, tokens_cached: int) -> None:
        """The request holds ``tokens_cached`` tokens once this step's tokens are written (before eviction)."""
        account = self.requests.get(request_id)
        if account is not None:
            account.peak_tokens_cached = max(account.peak_tokens_cached, tokens_cached)

    def evicted(self, request_id: str, tokens: int) -> None:
        """This step's eviction drops ``tokens`` of the request's tokens (its pages are freed next step)."""
        account = self.requests.get(request_id)
        if account is not None:
            account.tokens_evicted += tokens
        self.step.tokens_evicted += tokens
        self._evicted_in_step = True

    def compressed(self, request_id: str, tokens: int, pages: int) -> None:
        """Elastic mode: the request gave up ``tokens`` tokens and ``pages`` pages (freed at once)."""
        self.evicted(request_id, tokens)
        self.freed(request_id, pages)
        self.step.elastic_compressions += 1

    def refused(self) -> None:
        """A request was refused at the engine's intake (it never ran)."""
        self.step.refused_requests += 1

    def prefix_pages(self, *, copied: int = 0, uncached: int = 0) -> None:
        """Prefix caching: pages a request copied, or took out of the cache, before writing into them."""
        self.step.prefix_copied_pages += copied
        self.step.prefix_uncached_pages += uncached

    def end_step(self) -> None:
        self.step.eviction_steps += int(self._evicted_in_step)
        self._evicted_in_step = False

    def freed(self, request_id: str, pages: int) -> None:
        account = self.requests.get(request_id)
        if account is not None:
            account.pages_freed += pages
        self.step.pages_freed += pages

    def report(self, request_id: str, tokens_cached: int) -> dict[str, Any] | None:
        account = self.requests.get(request_id)
        if account is None:
            return None
        return RequestEvictionStats(
            policy=account.policy, budget=account.budget, tokens_evicted=account.tokens_evicted,
            tokens_cached=tokens_cached, peak_tokens_cached=max(account.peak_tokens_cached, tokens_cached),
            pages_freed=account.pages_freed).to_dict()

    def finish(self, request_id: str, tokens_cached: int) -> dict[str, Any] | None:
        """The request's final report; its account is dropped and it counts as finished under its policy."""
        report = self.report(request_id, tokens_cached)
        account = self.requests.pop(request_id, None)
        self.every_output.discard(request_id)
        if account is not None:
            counts = self.step.finished_requests
            counts[account.policy] = counts.get(account.policy, 0) + 1
        return report

    def observe_worker(self, report: WorkerReport | None) -> None:
        if report is None:
            return
        self.worker_requests = report.tracked_requests
        if self.log_stats:
            self.step.step_seconds.extend(report.eviction_seconds)

    def take_step_stats(self, *, tokens_cached: int, tokens_logical: int,
                        scheduler_requests: int) -> EvictionStepStats:
        step, self.step = self.step, EvictionStepStats()
        step.tokens_cached, step.tokens_logical = tokens_cached, tokens_logical
        step.scheduler_requests, step.worker_requests = scheduler_requests, self.worker_requests
        return step


def with_report(kv_transfer_params: dict[str, Any] | None, report: dict[str, Any] | None) -> dict[str, Any] | None:
    """``kv_transfer_params`` with the eviction report under ``KEY`` (a KV connector's keys are kept)."""
    if report is None:
        return kv_transfer_params
    return {**(kv_transfer_params or {}), KEY: report}
