"""The chart's command line is a working server: the container command and arguments of the Deployment
rendered from values-cpu.yaml (plus tests/deploy/values/server.yaml: small KV pool, short limits) run
here as they are, with three swaps: the model path becomes the local SmolLM2 test model, the host
127.0.0.1 and the port a free one. The server must answer on the readiness probe's path, run with
eviction on, and answer the ServiceMonitor's scrape path.

Run alone: ``.venv/bin/python -m pytest -m server tests/deploy/test_chart_server.py -v``: about 35 s on a
quiet 2-core machine (most of it start-up).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs vLLM (make install)")
pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")
httpx = pytest.importorskip("httpx")

from tests.deploy.chart import chart, container, env_of, find, merge_values, profile, render, values_file  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

SOURCES = (profile("cpu"), values_file("server"))
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_EVICT_TEST_SERVER_STARTUP_S", "240"))
SCHEDULER_LINE = "vllm_evict: scheduler vllm_evict.engine.scheduler.EvictScheduler"
PROMPT = "The grass is green. The sky is blue. " * 12 + "What color is the sky? The sky is"


@dataclass
class Server:
    url: str
    model: str  # --served-model-name
    command: list[str]
    log: Path
    process: subprocess.Popen

    def log_tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- last {lines} lines of {self.log} ---\n" + "\n".join(text.splitlines()[-lines:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def swap(args: list[str], flag: str, value: str) -> None:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in the chart's args {args}"
    args[args.index(flag) + 1] = value


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core), then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    time.sleep(1)  # the group's other members exit right after the leader
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    values = chart().merge_values(merge_values(*SOURCES))  # defaults + user values, as helm computes them
    deployment = find(render(*SOURCES), "Deployment")
    spec = container(deployment, "server")
    probe_path = spec["readinessProbe"]["httpGet"]["path"]

    # The rendered command line, as the kubelet would run it in the cpu image.
    executable, *rest = spec["command"]
    local = Path(sys.executable).parent / executable  # the image puts its venv on PATH; this is ours
    assert local.exists(), f"the chart runs {executable!r}, which this environment lacks ({local})"
    args = list(spec["args"])
    assert args[0] == values["model"]["path"], "the first argument is the model path"
    args[0] = str(smollm2_path)
    port = free_port()
    swap(args, "--host", "127.0.0.1")  # loopback only
    swap(args, "--port", str(port))
    command = [str(local), *rest, *args]

    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine tests' in-process switch; a pod has none
    # The compile caches' volume (compileCache) is a temporary folder here, mounted where the pod mounts it.
    mount, cache = values["compileCache"]["mountPath"], str(tmp_path_factory.mktemp("compile-cache"))
    rendered = {name: str(value) for name, value in env_of(spec).items()}
    assert rendered["TRITON_CACHE_DIR"].startswith(mount + "/"), rendered
    env.update({name: cache + value[len(mount):] if value.startswith(mount) else value
                for name, value in rendered.items()})
    log = tmp_path_factory.mktemp("chart-server") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    running = Server(url=f"http://127.0.0.1:{port}", model=args[args.index("--served-model-name") + 1],
                     command=command, log=log, process=process)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if process.poll() is not None:
                    pytest.fail(f"the chart's command exited with status {process.returncode} while starting\n"
                                f"{' '.join(command)}\n{running.log_tail()}")
                try:
                    if client.get(f"{running.url}{probe_path}").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"{probe_path} did not answer within {STARTUP_TIMEOUT_S:.0f} s\n"
                                f"{' '.join(command)}\n{running.log_tail()}")
                time.sleep(0.5)
        yield running
    finally:
        stop(process)
        print(f"\n[chart server log: {log}]")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, trust_env=False, timeout=120.0) as http:
        yield http


def test_command_line_is_the_charts(server: Server) -> None:
    """Guard the swaps: everything but model path, host and port is the rendered Deployment's."""
    spec = container(find(render(*SOURCES), "Deployment"), "server")
    rendered = [*spec["command"], *spec["args"]]
    ran = [Path(server.command[0]).name, *server.command[1:]]
    differing = [(a, b) for a, b in zip(rendered, ran) if a != b]
    assert len(rendered) == len(ran) and len(differing) == 3, differing
    assert "--kv-eviction" in ran and "--dtype" in ran and "--enforce-eager" in ran


def test_eviction_is_on(server: Server, client: Any) -> None:
    assert SCHEDULER_LINE in server.log.read_text(errors="replace"), server.log_tail()
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    # A per-request override: only a server started with --kv-eviction accepts one.
    answer = client.post("/v1/completions", json={**body, "vllm_xargs": {"kv_eviction": "keydiff", "kv_budget": 64}})
    assert answer.status_code == 200, f"{answer.text}\n{server.log_tail()}"
    assert answer.json()["usage"]["completion_tokens"] == 4
    # and checks it against the server's policy (snapkv keeps a window of 32).
    refused = client.post("/v1/completions", json={**body, "vllm_xargs": {"kv_budget": 8}})
    assert refused.status_code == 400, refused.text
    assert "budget 8 must be larger than the 32 tokens snapkv always keeps" in refused.text


def test_servicemonitor_path_answers(server: Server, client: Any) -> None:
    monitor = find(render(*SOURCES, values_file("servicemonitor")), "ServiceMonitor")
    path = monitor["spec"]["endpoints"][0]["path"]
    scrape = client.get(path)
    assert scrape.status_code == 200
    assert "vllm:num_requests_running" in scrape.text
