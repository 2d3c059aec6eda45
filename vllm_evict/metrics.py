"""Eviction metrics on vLLM's own ``/metrics`` (and ``LLM.get_metrics()``), in vLLM's conventions.

Every metric is declared once, in ``Metric`` below: name (``vllm:`` prefix; counters are exposed with
``_total``), type, help text and labels (``model_name`` and ``engine`` first, like vLLM's own metrics;
gauges use ``multiprocess_mode="mostrecent"`` so that several API server processes report the latest
value). Code refers to a metric only through its ``Metric`` member, so an unknown name cannot be
recorded.

``EvictionStatLogger`` is registered under vLLM's ``vllm.stat_logger_plugins`` entry point and loaded by
every ``AsyncLLM`` (each API server process); ``plugin.register()`` gives it to the offline ``LLMEngine``
as well, which does not read that entry point in vLLM 0.32/0.33. It is a ``PrometheusStatLogger``
subclass, so vLLM uses it instead of (not next to) its default Prometheus logger: vLLM's metrics stay
exactly as they are, and ours are added when the server runs with eviction. The engine core's numbers
arrive in ``SchedulerStats.kv_eviction`` (``engine/stats.py``); rejected requests are counted in the
front end, where they are refused (``record_rejection``), and those the engine core refuses at its intake
arrive with the step's stats (``refused_requests``, reason ``engine_intake``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from vllm_evict.config import ServerConfig
from vllm_evict.engine.stats import EvictionStepStats
from vllm_evict.stats import POLICY_NONE

logger = logging.getLogger("vllm.vllm_evict")

ENGINE_LABELS = ("model_name", "engine")
# Seconds of worker time spent evicting in one engine step: 100 us .. 10 s.
STEP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1.0, 2.5, 5.0, 10.0)
TRACKED_SIDES = ("scheduler", "worker")
# Why a request was refused: a bad value (invalid_settings), more than the server reserved at start-up
# (not_reserved), never fits the KV pool (does_not_fit): all counted in the front end, with HTTP 400;
# refused by the engine core's intake (engine_intake), for a request that did not come through a front end
# with this plugin (see vllm_evict.request_settings).
REJECTION_REASONS = ("invalid_settings", "not_reserved", "does_not_fit", "engine_intake")


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    documentation: str
    label: str | None = None  # one label after model_name (and engine)
    label_values: tuple[str, ...] = ()  # the label's values when they are a fixed set (created up front)
    per_engine: bool = True  # False: counted in the front end, which serves all engines (no engine label)
    buckets: tuple[float, ...] = ()


class Metric(enum.Enum):
    """The eviction metrics. Token counts are per sequence (every layer and KV head keeps the same count)."""

    EVICTED_TOKENS = MetricSpec(
        "vllm:kv_eviction_evicted_tokens", Kind.COUNTER, "Tokens dropped from the KV cache by eviction.")
    FREED_PAGES = MetricSpec(
        "vllm:kv_eviction_freed_pages", Kind.COUNTER, "KV-cache pages eviction returned to the block pool.")
    PREFIX_COPIED_PAGES = MetricSpec(
        "vllm:kv_eviction_prefix_copied_pages", Kind.COUNTER,
        "Prefix caching: pages a request copied (pages hashed or shared with other requests) before its first "
        "write into them; what sharing a cached prefix costs under eviction.")
    PREFIX_UNCACHED_PAGES = MetricSpec(
        "vllm:kv_eviction_prefix_uncached_pages", Kind.COUNTER,
        "Prefix caching: hashed pages a request held alone and took out of the prefix cache (a BlockRemoved "
        "event) to write them in place, the pool being too short for a copy.")
    EVICTION_STEPS = MetricSpec(
        "vllm:kv_eviction_steps", Kind.COUNTER, "Engine steps in which at least one request evicted tokens.")
    ELASTIC_COMPRESSIONS = MetricSpec(
        "vllm:kv_eviction_elastic_compressions", Kind.COUNTER,
        "Running elastic-mode requests compressed to make room in the KV pool where vLLM would otherwise "
        "preempt (vLLM's own preemptions: vllm:num_preemptions).")
    REQUESTS = MetricSpec(
        "vllm:kv_eviction_requests", Kind.COUNTER,
        "Finished requests (any finish reason) by the eviction policy applied to them; 'none': eviction off.",
        label="policy")
    STEP_SECONDS = MetricSpec(
        "vllm:kv_eviction_step_seconds", Kind.HISTOGRAM,
        "Worker time spent in eviction (scoring, state updates, compaction) per engine step that did any.",
        buckets=STEP_SECONDS_BUCKETS)
    CACHED_TOKENS = MetricSpec(
        "vllm:kv_eviction_cached_tokens", Kind.GAUGE, "Tokens physically in the KV cache, over running requests.")
    LOGICAL_TOKENS = MetricSpec(
        "vllm:kv_eviction_logical_tokens", Kind.GAUGE,
        "Logical tokens (computed so far) of running requests; minus cached_tokens: what eviction saves.")
    TRACKED_REQUESTS = MetricSpec(
        "vllm:kv_eviction_tracked_requests", Kind.GAUGE,
        "Requests the scheduler / worker (rank 0) hold eviction state for; 0 when the server is idle.",
        label="side", label_values=TRACKED_SIDES)
    REJECTED_REQUESTS = MetricSpec(
        "vllm:kv_eviction_rejected_requests", Kind.COUNTER,
        "Requests refused for their eviction settings: invalid, needing more than the server reserved, never "
        "fitting the KV pool (HTTP 400), or refused by the engine core's intake.",
        label="reason", label_values=REJECTION_REASONS, per_engine=False)


class EvictionMetrics:
    """The Prometheus objects of ``Metric``, for one served model and its engines."""

    def __init__(self, model_name: str, engine_indexes: list[int], classes: dict[Kind, type],
                 server_policy: str) -> None:
        self.model_name = model_name
        self.engine_indexes = engine_indexes
        self.families: dict[Metric, Any] = {}
        for metric in Metric:
            spec = metric.value
            labels = [*(ENGINE_LABELS if spec.per_engine else ENGINE_LABELS[:1]), *([spec.label] if spec.label else [])]
            kwargs: dict[str, Any] = dict(name=spec.name, documentation=spec.documentation, labelnames=labels)
            if spec.kind is Kind.GAUGE:
                kwargs["multiprocess_mode"] = "mostrecent"
            if spec.kind is Kind.HISTOGRAM:
                kwargs["buckets"] = list(spec.buckets)
            self.families[metric] = classes[spec.kind](**kwargs)
        # Create the children known up front, so that every family shows from the start (at 0).
        for metric in Metric:
            spec = metric.value
            values = spec.label_values or ((server_policy, POLICY_NONE) if metric is Metric.REQUESTS else (None,))
            for engine in engine_indexes if spec.per_engine else (None,):
                for value in values:
                    self.child(metric, engine, value)

    def child(self, metric: Metric, engine: int | None, label_value: str | None = None) -> Any:
        spec = metric.value
        if spec.label_values and label_value not in spec.label_values:
            raise ValueError(f"{spec.name}: {spec.label} must be one of {spec.label_values}, got {label_value!r}")
        if (label_value is None) != (spec.label is None):
            raise ValueError(f"{spec.name}: label {spec.label!r} needs a value" if spec.label
                             else f"{spec.name} has no label, got {label_value!r}")
        values = [self.model_name, *([str(engine)] if spec.per_engine else []),
                  *([label_value] if label_value is not None else [])]
        return self.families[metric].labels(*values)

    def observe(self, step: EvictionStepStats, engine: int) -> None:
        self.child(Metric.EVICTED_TOKENS, engine).inc(step.tokens_evicted)
        self.child(Metric.FREED_PAGES, engine).inc(step.pages_freed)
        self.child(Metric.EVICTION_STEPS, engine).inc(step.eviction_steps)
        self.child(Metric.PREFIX_COPIED_PAGES, engine).inc(step.prefix_copied_pages)
        self.child(Metric.PREFIX_UNCACHED_PAGES, engine).inc(step.prefix_uncached_pages)
        self.child(Metric.ELASTIC_COMPRESSIONS, engine).inc(step.elastic_compressions)
        if step.refused_requests:
            self.child(Metric.REJECTED_REQUESTS, None, "engine_intake").inc(step.refused_requests)
        for policy, count in step.finished_requests.items():
            self.child(Metric.REQUESTS, engine, policy).inc(count)
        for seconds in step.step_seconds:
            self.child(Metric.STEP_SECONDS, engine).observe(seconds)
        self.child(Metric.CACHED_TOKENS, engine).set(step.tokens_cached)
        self.child(Metric.LOGICAL_TOKENS, engine).set(step.tokens_logical)
        self.child(Metric.TRACKED_REQUESTS, engine, "scheduler").set(step.scheduler_requests)
        self.child(Metric.TRACKED_REQUESTS, engine, "worker").set(step.worker_requests)


# The metrics of the front end of this process (the most recently created logger), for rejections.
_frontend: EvictionMetrics | None = None


def record_rejection(reason: str) -> None:
    """Count a request refused for its eviction settings (no-op when no eviction metrics exist here)."""
    if _frontend is not None:
        _frontend.child(Metric.REJECTED_REQUESTS, None, reason).inc()


class EvictionStatLogger(PrometheusStatLogger):
    """vLLM's Prometheus logger plus the eviction metrics (only when the server runs with eviction)."""

    # The OpenAI server's streamed responses need the per-request stats backfilled on vLLM 0.32.
    installs_openai_hooks = True

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        global _frontend
        super().__init__(vllm_config, engine_indexes)  # unregisters earlier "vllm:" collectors
        self.eviction: EvictionMetrics | None = None
        self._warned = False
        mapping = (vllm_config.additional_config or {}).get("kv_eviction")
        if not mapping:
            return
        classes = {Kind.COUNTER: self._counter_cls, Kind.GAUGE: self._gauge_cls, Kind.HISTOGRAM: self._histogram_cls}
        self.eviction = EvictionMetrics(vllm_config.model_config.served_model_name, list(self.engine_indexes),
                                        classes, ServerConfig.from_mapping(mapping).eviction.policy)
        _frontend = self.eviction
        if self.installs_openai_hooks:
            from vllm_evict.openai_server import install

            install()

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: MultiModalCacheStats | None = None, engine_idx: int = 0) -> None:
        super().record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)
        if self.eviction is None or scheduler_stats is None:
            return
        step = getattr(scheduler_stats, "kv_eviction", None)
        if step is not None:
            self.eviction.observe(step, engine_idx)
        elif not self._warned:
            self._warned = True
            logger.warning("vllm_evict: the engine core's SchedulerStats arrived without eviction stats "
                           "(%s); the eviction metrics will not move", type(scheduler_stats).__name__)


class OfflineEvictionStatLogger(EvictionStatLogger):
    """For ``LLM`` (``LLMEngine``): no HTTP server, so no OpenAI hooks."""

    installs_openai_hooks = False
