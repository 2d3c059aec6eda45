"""Per-request eviction stats on the RequestOutput and the eviction metrics of the offline LLM
(``llm.get_metrics()``), against the shared schedule rule (tests/eviction_oracle.py) and the scheduler's
own state, in the real engine (tiny random Llama, in process; one case in the multiprocess engine).

About 1-2 min on a quiet 2-core machine (most of it the multiprocess case's start-up)."""

from __future__ import annotations

import json
from typing import Any, Iterator

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from tests.engine.helpers import BLOCK, MULTIPROCESS_SERVER, TEST_RUNNER, Engine, greedy, make_llm, token_prompt
from tests.eviction_oracle import expected_run
from vllm_evict.config import EvictionConfig
from vllm_evict.request_settings import resolve_request_config
from vllm_evict.engine.stats import WORKER_REPORT_ATTR, WorkerReport, attach_worker_report
from vllm_evict.engine.step_timer import StepTimer
from vllm_evict.metrics import Metric, MetricSpec
from vllm_evict.stats import KEY, RequestEvictionStats, eviction_stats

pytestmark = pytest.mark.engine

SERVER = {"policy": "snapkv", "budget": 64}
CHUNK = 64  # make_llm's max_num_batched_tokens
PROMPT, MAX_TOKENS = 200, 50  # decode grows past budget + slack (32) once: every kind of eviction happens


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[Engine]:
    built = Engine(make_llm(tiny_llama, SERVER, disable_log_stats=False))
    yield built
    built.llm.llm_engine.engine_core.shutdown()


def snapshot(engine: Engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every vllm: counter, gauge and histogram count, by (name, labels)."""
    values = {}
    for metric in engine.llm.get_metrics():
        value = getattr(metric, "value", None)
        if value is None:
            value = getattr(metric, "count", None)
        if value is not None:
            values[(metric.name, tuple(sorted(metric.labels.items())))] = float(value)
    return values


def metric(values: dict, spec: MetricSpec, **labels: str) -> float:
    found = [v for (name, got), v in values.items() if name == spec.name and dict(got).items() >= labels.items()]
    assert len(found) == 1, f"{spec.name} {labels}: {found}"
    return found[0]


def delta(before: dict, after: dict, spec: MetricSpec, **labels: str) -> float:
    return metric(after, spec, **labels) - (metric(before, spec, **labels) if _has(before, spec, labels) else 0.0)


def _has(values: dict, spec: MetricSpec, labels: dict) -> bool:
    return any(name == spec.name and dict(got).items() >= labels.items() for (name, got) in values)


def settle(engine: Engine) -> dict:
    """Run the engine's last step, which tells the worker which requests finished (a server's engine runs
    it by itself; offline ``LLM.generate`` returns before it), then snapshot the metrics."""
    while engine.scheduler.has_requests():
        engine.llm.llm_engine.step()
    return snapshot(engine)


def assert_idle(engine: Engine, values: dict) -> None:
    for spec, labels in ((Metric.CACHED_TOKENS.value, {}), (Metric.LOGICAL_TOKENS.value, {}),
                         (Metric.TRACKED_REQUESTS.value, {"side": "scheduler"}),
                         (Metric.TRACKED_REQUESTS.value, {"side": "worker"})):
        assert metric(values, spec, **labels) == 0, (spec.name, labels)
    scheduler = engine.scheduler
    assert not (scheduler.eviction_configs or scheduler.evicted or scheduler.pending_keep
                or scheduler.accounting.requests or scheduler.accounting.every_output)
    assert not engine.runner.evict_rows.held_requests()


# ---- one request alone: exact stats and exact metric increments ------------------------------------
@pytest.mark.parametrize("xargs", [{}, {"kv_eviction": "keydiff", "kv_budget": 96}, {"kv_eviction": "none"}],
                         ids=["server-snapkv", "override-keydiff-96", "none"])
def test_request_stats_and_metrics_follow_the_schedule_rule(engine: Engine, xargs: dict[str, Any]) -> None:
    config = resolve_request_config(SERVER, xargs)
    expected = expected_run(config, prompt_len=PROMPT, max_tokens=MAX_TOKENS, chunk=CHUNK, page=BLOCK)
    before = snapshot(engine)
    output = engine.llm.generate([token_prompt(PROMPT, 3)], greedy(MAX_TOKENS, **xargs))[0]
    after = settle(engine)

    stats = eviction_stats(output)
    assert stats == expected.stats
    assert stats.tokens_evicted == PROMPT + MAX_TOKENS - 1 - stats.tokens_cached  # logical - cached
    assert set(output.kv_transfer_params) == {KEY}
    if config is not None:
        assert stats.tokens_evicted > 0 and stats.pages_freed > 0 and expected.eviction_steps >= 2

    assert delta(before, after, Metric.EVICTED_TOKENS.value) == stats.tokens_evicted
    assert delta(before, after, Metric.FREED_PAGES.value) == stats.pages_freed
    assert delta(before, after, Metric.EVICTION_STEPS.value) == expected.eviction_steps
    assert delta(before, after, Metric.REQUESTS.value, policy=stats.policy) == 1
    # One observation per engine step that ran eviction work for the request (none: no work at all).
    assert delta(before, after, Metric.STEP_SECONDS.value) == (expected.work_steps if config else 0)
    assert_idle(engine, after)


def test_mixed_batch_counters_add_up_the_requests(engine: Engine) -> None:
    requests = [({}, 200), ({"kv_eviction": "keydiff", "kv_budget": 96}, 260), ({"kv_eviction": "none"}, 150),
                ({"kv_budget": 48, "kv_eviction_config": {"window": 16}}, 230)]
    before = snapshot(engine)
    outputs = engine.llm.generate([token_prompt(length, 5 + i) for i, (_, length) in enumerate(requests)],
                                  [greedy(40, **xargs) for xargs, _ in requests])
    after = settle(engine)
    stats = [eviction_stats(out) for out in outputs]
    for (xargs, length), got in zip(requests, stats):
        config = resolve_request_config(SERVER, xargs)
        assert (got.policy, got.budget) == ((config.policy, config.budget) if config else ("none", None))
        assert got.tokens_evicted == length + 40 - 1 - got.tokens_cached
        assert got.peak_tokens_cached >= got.tokens_cached
    assert stats[2].tokens_evicted == stats[2].pages_freed == 0
    assert delta(before, after, Metric.EVICTED_TOKENS.value) == sum(s.tokens_evicted for s in stats)
    assert delta(before, after, Metric.FREED_PAGES.value) == sum(s.pages_freed for s in stats)
    for policy in ("snapkv", "keydiff", "none"):
        assert delta(before, after, Metric.REQUESTS.value, policy=policy) == sum(s.policy == policy for s in stats)
    assert_idle(engine, after)


def test_n_above_one_evicts_every_sequence_and_reports_one(engine: Engine) -> None:
    """``n = 3``: vLLM runs three requests in the engine, each evicted by the schedule rule; the response
    carries one ``kv_transfer_params`` (one sequence's stats: docs/compatibility.md), the metrics count all."""
    if TEST_RUNNER == "v2":
        pytest.skip("vLLM's front end fans n out into requests, whatever the runner; V1 pass only (20 s on V2)")
    config = resolve_request_config(SERVER, {})
    max_tokens = BLOCK + 8  # the decode grows past budget + one page once
    expected = expected_run(config, prompt_len=PROMPT, max_tokens=max_tokens, chunk=CHUNK, page=BLOCK)
    assert expected.eviction_steps == 2  # after the prompt, and once while decoding
    before = snapshot(engine)
    params = SamplingParams(n=3, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    (output,) = engine.llm.generate([token_prompt(PROMPT, 11)], params)
    after = settle(engine)
    assert [len(c.token_ids) for c in output.outputs] == [max_tokens] * 3
    assert eviction_stats(output) == expected.stats
    assert delta(before, after, Metric.REQUESTS.value, policy="snapkv") == 3
    assert delta(before, after, Metric.EVICTED_TOKENS.value) == 3 * expected.stats.tokens_evicted
    assert_idle(engine, after)


def test_prompt_logprobs_see_the_cache_as_eviction_left_it(engine: Engine) -> None:
    """Prompt logprobs come from the prefill's own forward passes: with SnapKV's one-shot schedule the
    whole prompt is cached until it ends, so they equal a full cache's; with the chunked schedule the
    chunks after the first eviction attend over the kept tokens only, so theirs differ."""
    if TEST_RUNNER == "v2":
        pytest.skip("what attention sees is the runner-independent eviction step; V1 pass only (10 s on V2)")
    prompt = token_prompt(PROMPT, 13)

    def prompt_logprobs(**xargs: Any) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, extra_args=xargs or None)
        (output,) = engine.llm.generate([prompt], params)
        ids = prompt["prompt_token_ids"]
        return [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])]

    full = prompt_logprobs(kv_eviction="none")
    assert len(full) == PROMPT - 1
    assert prompt_logprobs() == pytest.approx(full, abs=1e-5)
    chunked = prompt_logprobs(kv_eviction_config={"schedule": "chunked"})
    # Chunks of 64: the first eviction runs after the second chunk (128 > budget 64); tokens 1..128 are
    # scored before it, the third chunk's after it.
    assert chunked[:2 * CHUNK] == pytest.approx(full[:2 * CHUNK], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(chunked[2 * CHUNK:], full[2 * CHUNK:])) > 1e-3
    settle(engine)


def test_stop_string_request_reports_at_the_output_that_stopped_it(engine: Engine) -> None:
    """The front end ends it (the detokenizer finds the stop string in the first token, " t..."), at an
    output the engine core did not know to be the last: such requests get the stats on every output."""
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=["t"])
    output = engine.llm.generate([token_prompt(PROMPT, 9)], params)[0]
    assert output.outputs[0].finish_reason == "stop" and len(output.outputs[0].token_ids) == 1
    # The state after the step that produced the first token: the prompt, evicted to the budget.
    first_output = expected_run(EvictionConfig.from_mapping(SERVER), prompt_len=PROMPT, max_tokens=1, chunk=CHUNK,
                                page=BLOCK)
    assert eviction_stats(output) == first_output.stats
    assert_idle(engine, settle(engine))


def test_rejected_override_counts_once_and_moves_nothing_else(engine: Engine) -> None:
    before = snapshot(engine)
    with pytest.raises(VLLMValidationError, match=r"kv_budget must be an integer in \[1, 2048\], got -5"):
        engine.llm.generate([token_prompt(50)], greedy(4, kv_budget=-5))
    after = snapshot(engine)
    assert delta(before, after, Metric.REJECTED_REQUESTS.value, reason="invalid_settings") == 1
    rejected = Metric.REJECTED_REQUESTS.value.name
    assert {k: v for k, v in after.items() if k[0] != rejected} == {k: v for k, v in before.items() if k[0] != rejected}


# ---- the default multiprocess engine: stats cross the process boundary ---------------------------
def test_offline_multiprocess_engine_reports_stats_and_metrics(tiny_llama: str, multiprocess_run: dict) -> None:
    got = multiprocess_run  # its first request, before any other ran in that engine (tests/engine/conftest.py)
    assert MULTIPROCESS_SERVER == SERVER
    expected = expected_run(EvictionConfig.from_mapping(SERVER), prompt_len=200, max_tokens=50, chunk=CHUNK,
                            page=BLOCK)
    assert RequestEvictionStats.from_dict(got["stats"]) == expected.stats
    labels = {"engine": "0", "model_name": tiny_llama}
    metrics = got["metrics"]

    def value(spec: MetricSpec, **extra: str) -> float:
        return metrics[spec.name + json.dumps({**labels, **extra}, sort_keys=True)]

    assert value(Metric.EVICTED_TOKENS.value) == expected.stats.tokens_evicted
    assert value(Metric.FREED_PAGES.value) == expected.stats.pages_freed
    assert value(Metric.EVICTION_STEPS.value) == expected.eviction_steps
    assert value(Metric.STEP_SECONDS.value) == expected.work_steps
    assert value(Metric.REQUESTS.value, policy="snapkv") == 1
    assert value(Metric.TRACKED_REQUESTS.value, side="scheduler") == 0
    # The worker learns that the request finished in the engine's next step, whose stats LLM.generate
    # does not wait for (in-process: settle(); a server's engine reports it by itself).


# ---- small parts -----------------------------------------------------------------------------------
def test_metric_table_follows_vllm_conventions() -> None:
    names = [m.value.name for m in Metric]
    assert len(names) == len(set(names))
    for name in names:
        assert name.startswith("vllm:kv_eviction_") and not name.endswith("_total"), name


def test_worker_report_never_mutates_vllms_empty_output() -> None:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    report = WorkerReport(eviction_seconds=(), tracked_requests=0)
    out = attach_worker_report(EMPTY_MODEL_RUNNER_OUTPUT, report)
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT and getattr(out, WORKER_REPORT_ATTR) is report
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, WORKER_REPORT_ATTR)
    assert attach_worker_report(None, report) is None


def test_step_timer_sums_layers_and_resets() -> None:
    timer = StepTimer("cpu")
    assert timer.take() == []  # step 0: no eviction work
    for _ in range(3):
        with timer:
            sum(range(1000))
    first = timer.take()  # step 1
    assert [s.step for s in first] == [1] and first[0].seconds > 0
    assert timer.take() == [] and timer.pending_from == 3


class DeviceStream:
    """CUDA's event semantics on one stream, the device's progress driven by the test: events complete in
    the order they were recorded; ``query`` never waits; ``synchronize`` waits (counted)."""

    def __init__(self) -> None:
        self.recorded: list["DeviceEvent"] = []
        self.done = 0  # events completed so far
        self.waits = 0

    def event(self) -> "DeviceEvent":
        return DeviceEvent(self)

    def advance(self, events: int) -> None:
        self.done = min(len(self.recorded), self.done + events)


class DeviceEvent:
    def __init__(self, stream: DeviceStream) -> None:
        self.stream, self.index = stream, -1

    def record(self) -> None:
        self.index = len(self.stream.recorded)
        self.stream.recorded.append(self)

    def query(self) -> bool:
        return self.index < self.stream.done

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.done = max(self.stream.done, self.index + 1)

    def elapsed_time(self, end: "DeviceEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not completed"
        return float(end.index - self.index)  # milliseconds: one per event between them


def test_step_timer_reads_device_events_late_and_never_waits() -> None:
    """On a device, a step's time comes out of the first ``take()`` after its events completed; ``take()``
    never waits for the device (the host may be a step ahead of it), ``flush()`` does."""
    stream = DeviceStream()
    timer = StepTimer(event=stream.event)
    for _ in range(2):  # step 0: two layers with work (events 0-1, 2-3)
        with timer:
            pass
    assert timer.take() == [] and timer.pending_from == 0  # the device has not run them yet
    assert timer.take() == []  # step 1: no eviction work
    with timer:  # step 2: events 4-5
        pass
    stream.advance(4)  # the device finished step 0
    assert timer.take() == [(0, 0.002)] and timer.pending_from == 2
    with timer:  # step 3: events 6-7 (reused from step 0's)
        pass
    assert timer.take() == [] and len(stream.recorded) == 8
    assert timer.flush() == [(2, 0.001), (3, 0.001)] and timer.pending_from == 4
    assert stream.waits == 1, "only flush() waits, once, for the last pending event"