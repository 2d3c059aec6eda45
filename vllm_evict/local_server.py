"""A ``python -m vllm_evict serve`` process on loopback, and its ``/metrics``, for the tests and the
benchmarks (soak, plots). The server runs exactly as a user would start it (default multiprocess engine);
its output goes to a log file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# A chat template for models without one (the tiny test Llama): the messages' texts, space-separated.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

MetricKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LocalServer:
    url: str
    log: Path
    process: subprocess.Popen

    @classmethod
    def start(cls, model: str, args: Iterable[str], *, log: Path, env: dict[str, str] | None = None,
              startup_timeout_s: float = 300.0, cwd: Path | None = None) -> "LocalServer":
        """Start the server and wait until ``/health`` answers (raises with the log's tail otherwise)."""
        import httpx

        port = free_port()
        command = [sys.executable, "-m", "vllm_evict", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                   *args]
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
        full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine tests' in-process switch
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            process = subprocess.Popen(command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(url=f"http://127.0.0.1:{port}", log=log, process=process)
        deadline = time.monotonic() + startup_timeout_s
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited with status {process.returncode} while starting\n"
                                       f"{server.log_tail()}")
                try:
                    if client.get(f"{server.url}/health").status_code == 200:
                        return server
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"the server did not answer /health within {startup_timeout_s:.0f} s\n"
                                       f"{server.log_tail()}")
                time.sleep(1.0)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM the server's process group (API servers, engine core, workers), then SIGKILL the rest."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(1)  # the group's other members exit right after the leader; SIGKILL any straggler
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return f"--- last {lines} lines of {self.log} ---\n" + "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self, client: Any = None) -> dict[MetricKey, float]:
        return scrape(self.url, client)


def parse_metrics(text: str) -> dict[MetricKey, float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(url: str, client: Any = None) -> dict[MetricKey, float]:
    import httpx

    if client is None:
        with httpx.Client(trust_env=False, timeout=30.0) as own:
            return scrape(url, own)
    response = client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse_metrics(response.text)


def sample(values: dict[MetricKey, float], name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels`` (0 when absent)."""
    found = [v for (n, got), v in values.items() if n == name and dict(got).items() >= labels.items()]
    if len(found) > 1:
        raise ValueError(f"{name} {labels} matches {len(found)} samples")
    return found[0] if found else 0.0
