"""The short soak (benchmarks/soak.py): 60 mixed requests, 8 at a time, against a real server (tiny Llama,
a 24-page KV pool that makes vLLM preempt), hostile ones among them, then the checks that nothing is left
behind. About 2 min on a
quiet 2-core machine (start-up included); the 1000-request run with SmolLM2 is in docs/observability.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.scripts import loaded_script

pytest.importorskip("vllm", reason="the soak needs vLLM (make install)")

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]



@pytest.fixture(scope="module")
def soak() -> Iterator[Any]:
    with loaded_script("benchmarks/soak.py", "bench_soak") as module:
        yield module


def test_workload_has_every_kind_of_request(soak: Any) -> None:
    jobs = soak.make_jobs(1000, 0, soak.PROFILES["smollm2"], 8)
    kinds = {kind: sum(j.kind == kind for j in jobs) for kind in ("good", "disconnect", "bad", "hostile")}
    assert 30 <= kinds["bad"] <= 70 and 150 <= kinds["disconnect"] <= 250 and 70 <= kinds["hostile"] <= 130, kinds
    hostile = {json.dumps(j.xargs, sort_keys=True) for j in jobs if j.kind == "hostile"}
    assert len(hostile) == len(soak.HOSTILE_XARGS), "every hostile setting is in the 1000-request run"
    assert all(j.expect_error for j in jobs if j.kind == "hostile")
    lengths = [j.prompt_len for j in jobs if j.kind == "good"]
    assert min(lengths) <= 10 and max(lengths) >= 2000
    gens = [j.max_tokens for j in jobs if j.kind == "good"]
    assert min(gens) == 1 and max(gens) >= 200
    assert {j.endpoint for j in jobs} == {"completions", "chat"} and {j.stream for j in jobs} == {True, False}
    assert {j.sampled for j in jobs} == {True, False}
    policies = {(j.xargs or {}).get("kv_eviction", "server") for j in jobs if j.kind == "good"}
    assert {"server", "none", "snapkv", "h2o"} <= policies
    assert any(j.xargs and set(j.xargs) == {"kv_budget"} for j in jobs)
    assert any(j.expect_error and "this request needs up to" in j.expect_error for j in jobs)


def test_short_soak_passes(soak: Any, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    status = soak.main(["--tiny", "--requests", "60", "--concurrency", "8", "--quiet", "--out", str(out),
                        "--log", str(tmp_path / "server.log")])
    report = json.loads(out.read_text())
    assert status == 0, report["summary"]
    assert report["passed"] and not report["problems"] and not report["left_on_metrics"]
    assert report["counters"]["preemptions"] > 0, "the KV pool did not make vLLM preempt"
    assert report["counters"]["rejected"] == report["kinds"]["bad"] + report["kinds"]["hostile"]
    assert report["kinds"]["bad"] > 0 and report["kinds"]["hostile"] > 0
    assert report["counters"]["evicted tokens"] > 0 and report["counters"]["freed pages"] > 0
