"""A real OpenAI-compatible server with eviction for the metrics and per-request stats tests.

One server for the session (started by the first test that asks for it): the tiny random Llama with
``--kv-eviction snapkv --kv-budget 64`` and two API server processes (``--api-server-count 2``), so the
eviction metrics go through vLLM's multiprocess Prometheus mode and the requests are spread over both
front ends. The engine core is its own process, as served by default. Start-up: about 40 s on a quiet
2-core machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytest.importorskip("vllm", reason="the server tests need vLLM (make install)")
httpx = pytest.importorskip("httpx")

from vllm_evict.local_server import PLAIN_CHAT_TEMPLATE, LocalServer, MetricKey  # noqa: E402
from vllm_evict.testing import build_tiny_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEST_RUNNER = os.environ.get("VLLM_EVICT_TEST_RUNNER", "v1")
EVICTION = {"policy": "snapkv", "budget": 64}
CHUNK, PAGE = 64, 32  # --max-num-batched-tokens, --block-size
MODEL = "tiny"
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_EVICT_TEST_SERVER_STARTUP_S", "300"))


@pytest.fixture(scope="session")
def evict_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-server"))
    log = tmp_path_factory.mktemp("evict-server") / "server.log"
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--max-model-len", "2048", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8",
            "--block-size", str(PAGE), "--chat-template", PLAIN_CHAT_TEMPLATE, "--api-server-count", "2",
            "--kv-eviction", EVICTION["policy"], "--kv-budget", str(EVICTION["budget"])]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    try:
        server = LocalServer.start(str(model), args, log=log, env=env, startup_timeout_s=STARTUP_TIMEOUT_S, cwd=REPO)
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        # The engine core runs the model runner the suite was started for (tests/conftest.py).
        runner_log = "Using V2 Model Runner" in log.read_text(errors="replace")
        assert runner_log == (TEST_RUNNER == "v2"), f"the server runs the wrong model runner; see {log}"
        yield server
    finally:
        server.stop()
        print(f"\n[server log: {log}]")


@pytest.fixture(scope="session")
def http(evict_server: LocalServer) -> Iterator[Any]:
    with httpx.Client(base_url=evict_server.url, trust_env=False, timeout=120.0) as client:
        yield client


def words(count: int, offset: int = 0) -> str:
    """A prompt of exactly ``count`` tokens for the tiny model's word-level tokenizer."""
    return " ".join(f"t{(offset + 37 * i) % 400}" for i in range(count))


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Poll until ``condition()`` is truthy: the engine core's stats reach the API servers a moment after
    the response, and with two API servers either one may get them."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def counters(values: dict[MetricKey, float], prefix: str = "vllm:") -> dict[MetricKey, float]:
    return {k: v for k, v in values.items() if k[0].startswith(prefix) and k[0].endswith("_total")}
