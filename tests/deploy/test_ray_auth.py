"""The chart's Ray token wiring against a real Ray 2.60 head on loopback.

The chart gives the head pod and the worker pods ``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN_PATH`` (a mount
of one Secret's key). This starts ``ray start --head`` with the head container's rendered Ray variables
and the rendered Secret's token in a file, then runs the command the worker pods wait with
(``ray health-check --address``): with the worker container's variables it passes, without the token or
with another one Ray refuses it. Measured: 45 s wall, 12 s CPU, on the 2-core machine at load ~16
(18 s of it the head's start-up).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")
pytest.importorskip("ray", reason="needs ray (pip install vllm-evict[ray])")

from tests.deploy.chart import container, env_of, find, profile, render  # noqa: E402

RAY = Path(sys.executable).with_name("ray")
TOKEN_MOUNT = "/etc/vllm-evict/ray-auth/token"  # where the chart mounts the Secret's key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_env(box: dict[str, Any], token_file: Path) -> dict[str, str]:
    """The container's rendered ``RAY_AUTH_*`` variables, the token mount path replaced by ``token_file``."""
    chosen = {name: value for name, value in env_of(box).items() if name.startswith("RAY_AUTH_")}
    assert chosen.get("RAY_AUTH_TOKEN_PATH") == TOKEN_MOUNT, chosen
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    return {**env, **chosen, "RAY_AUTH_TOKEN_PATH": str(token_file), "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def chart_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    objects = render(profile("gpu"), profile("ray-gpu"))
    token_file = tmp_path_factory.mktemp("ray-auth") / "token"
    secret = find(objects, "Secret")
    token_file.write_bytes(base64.b64decode(secret["data"]["token"]))
    head_env = ray_env(container(find(objects, "Deployment"), "server"), token_file)
    worker_env = ray_env(container(find(objects, "StatefulSet"), "ray-worker"), token_file)
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="rayauth", dir="/tmp")  # Ray's socket paths must stay short
    log_path = Path(temp_dir) / "head.log"
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir],
            env=head_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log_path.read_text():
            assert head.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not start in 120 s"
            time.sleep(0.5)
        yield {"address": f"127.0.0.1:{port}", "worker_env": worker_env, "token_file": token_file}
    finally:
        head.terminate()  # `ray start --block` stops the cluster's processes when it is terminated
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def health_check(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(RAY), "health-check", "--address", address], env=env, capture_output=True,
                          text=True, timeout=120)


def test_worker_with_the_charts_token_reaches_the_head(chart_head: dict[str, Any]) -> None:
    result = health_check(chart_head["address"], chart_head["worker_env"])
    assert result.returncode == 0, result.stderr[-2000:]


def test_ray_refuses_a_worker_without_the_token(chart_head: dict[str, Any], tmp_path: Path) -> None:
    no_token = {k: v for k, v in chart_head["worker_env"].items() if not k.startswith("RAY_AUTH_")}
    other = tmp_path / "other-token"
    other.write_text("0" * 64)
    wrong_token = dict(chart_head["worker_env"], RAY_AUTH_TOKEN_PATH=str(other))
    for env in (no_token, wrong_token):
        result = health_check(chart_head["address"], env)
        assert result.returncode != 0
        assert "Authentication token is missing or incorrect" in result.stderr
