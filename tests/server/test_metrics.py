"""The eviction metrics on the server's own /metrics, scraped over HTTP from the session's server (tiny
Llama, snapkv@64, two API server processes; tests/server/conftest.py).

Requests run one at a time, so each one's effect on the counters is known exactly: from the shared schedule
rule (tests/eviction_oracle.py) and from the stats the server returned for it. About 20 s after start-up.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.eviction_oracle import expected_run
from tests.server.conftest import CHUNK, EVICTION, MODEL, PAGE, counters, wait_for, words
from vllm_evict.config import EvictionConfig
from vllm_evict.local_server import LocalServer, sample
from vllm_evict.metrics import Kind, Metric
from vllm_evict.stats import eviction_stats

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

ENGINE = {"model_name": MODEL, "engine": "0"}
EVICTED = Metric.EVICTED_TOKENS.value.name + "_total"
FREED = Metric.FREED_PAGES.value.name + "_total"
STEPS = Metric.EVICTION_STEPS.value.name + "_total"
REQUESTS = Metric.REQUESTS.value.name + "_total"
STEP_COUNT = Metric.STEP_SECONDS.value.name + "_count"
CACHED, LOGICAL, TRACKED = (m.value.name for m in (Metric.CACHED_TOKENS, Metric.LOGICAL_TOKENS, Metric.TRACKED_REQUESTS))
REJECTED = Metric.REJECTED_REQUESTS.value.name + "_total"


def complete(http: Any, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0.0, "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def idle(values: dict) -> bool:
    return all(sample(values, name, **ENGINE, **labels) == 0 for name, labels in (
        (CACHED, {}), (LOGICAL, {}), (TRACKED, {"side": "scheduler"}), (TRACKED, {"side": "worker"})))


def test_every_eviction_metric_is_exposed_in_vllms_conventions(evict_server: LocalServer, http: Any) -> None:
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for metric in Metric:
        spec = metric.value
        family = families.get(spec.name)
        assert family is not None, f"{spec.name} missing from /metrics"
        assert family.type == spec.kind.value and family.documentation == spec.documentation
        expected_labels = {"model_name", "engine"} if spec.per_engine else {"model_name"}
        expected_labels |= {spec.label} if spec.label else set()
        suffixes = {Kind.COUNTER: {"_total", "_created"}, Kind.GAUGE: {""},
                    Kind.HISTOGRAM: {"_bucket", "_count", "_sum", "_created"}}[spec.kind]
        for s in family.samples:
            assert s.name[len(spec.name):] in suffixes, s.name
            assert set(s.labels) - {"le"} == expected_labels, (s.name, s.labels)
            assert s.labels["model_name"] == MODEL
    # vLLM's own metrics are still there, from the same logger.
    assert "vllm:num_requests_running" in families and "vllm:kv_cache_usage_perc" in families


def test_a_request_adds_exactly_what_it_evicted(evict_server: LocalServer, http: Any) -> None:
    before = evict_server.metrics(http)
    body = complete(http, words(200, 1), 50)
    stats = eviction_stats(body)
    expected = expected_run(EvictionConfig.from_mapping(EVICTION), prompt_len=200, max_tokens=50, chunk=CHUNK,
                            page=PAGE)
    assert stats == expected.stats and stats.tokens_evicted > 0 and stats.pages_freed > 0

    def moved() -> dict | None:
        now = evict_server.metrics(http)
        done = sample(now, REQUESTS, **ENGINE, policy="snapkv") == sample(before, REQUESTS, **ENGINE, policy="snapkv") + 1
        return now if done and idle(now) else None

    after = wait_for(moved, "the request's stats on /metrics")
    change = {name: sample(after, name, **ENGINE) - sample(before, name, **ENGINE)
              for name in (EVICTED, FREED, STEPS, STEP_COUNT)}
    assert change == {EVICTED: stats.tokens_evicted, FREED: stats.pages_freed, STEPS: expected.eviction_steps,
                      STEP_COUNT: expected.work_steps}


def test_a_request_without_eviction_adds_to_none_only(evict_server: LocalServer, http: Any) -> None:
    before = evict_server.metrics(http)
    body = complete(http, words(150, 2), 10, vllm_xargs={"kv_eviction": "none"})
    assert eviction_stats(body).tokens_evicted == 0

    def moved() -> dict | None:
        now = evict_server.metrics(http)
        done = sample(now, REQUESTS, **ENGINE, policy="none") == sample(before, REQUESTS, **ENGINE, policy="none") + 1
        return now if done and idle(now) else None

    after = wait_for(moved, "the request on /metrics")
    for name in (EVICTED, FREED, STEPS, STEP_COUNT):
        assert sample(after, name, **ENGINE) == sample(before, name, **ENGINE), name


def test_a_bad_override_adds_one_rejection_and_changes_no_other_counter(evict_server: LocalServer, http: Any) -> None:
    before = counters(evict_server.metrics(http))
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": words(20), "max_tokens": 4,
                                                  "vllm_xargs": {"kv_eviction": "nope"}})
    assert response.status_code == 400
    assert "unknown eviction policy 'nope'" in response.json()["error"]["message"]

    def counted() -> dict | None:
        now = counters(evict_server.metrics(http))
        target = sample(before, REJECTED, reason="invalid_settings") + 1
        return now if sample(now, REJECTED, reason="invalid_settings") == target else None

    after = wait_for(counted, "the rejection on /metrics")
    assert {k: v for k, v in after.items() if k[0] != REJECTED} == {k: v for k, v in before.items() if k[0] != REJECTED}


def test_gauges_show_a_running_request_and_return_to_zero(evict_server: LocalServer, http: Any) -> None:
    # Streamed and long (1,600 decode steps, seconds even on a fast machine), so /metrics is scraped while
    # the request is known to be running: its first tokens have arrived and most of its steps are still to
    # come. (A 250-token request polled blindly took 0.8 s and once finished between two scrapes in CI.)
    prompt_len, max_tokens = 300, 1600
    first_token, done = threading.Event(), threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        body = {"model": MODEL, "prompt": words(prompt_len, 3), "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        try:
            with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        first_token.set()
                        result["stats"] = eviction_stats(chunk) or result.get("stats")
        finally:
            first_token.set()
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    assert first_token.wait(timeout=120), "no token streamed within 120 s"
    seen: dict[str, float] = {}

    def running() -> bool:
        now = evict_server.metrics(http)
        cached, logical = sample(now, CACHED, **ENGINE), sample(now, LOGICAL, **ENGINE)
        if 0 < cached < logical and sample(now, TRACKED, **ENGINE, side="scheduler") == 1 \
                and sample(now, TRACKED, **ENGINE, side="worker") == 1:
            seen.update(cached=cached, logical=logical)
            return True
        return done.is_set()  # finished before a scrape caught it running: fails below

    wait_for(running, "the gauges of a running request", timeout_s=120)
    finished_early = done.is_set()
    worker.join(timeout=300)
    assert seen, f"the request finished before /metrics showed it running (finished first: {finished_early})"
    assert prompt_len <= seen["logical"] < prompt_len + max_tokens  # the cached tokens, not yet the sampled one
    assert seen["cached"] <= EVICTION["budget"] + EvictionConfig.from_mapping(EVICTION).slack_for(PAGE)  # + decode slack
    wait_for(lambda: idle(evict_server.metrics(http)), "the gauges back at 0")
    stats = result.get("stats")
    assert stats is not None, "the final stream chunk carried no eviction stats"
    assert stats.tokens_evicted == prompt_len + max_tokens - 1 - stats.tokens_cached
