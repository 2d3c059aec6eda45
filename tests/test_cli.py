"""``python -m vllm_evict``: the command table and the ``policies`` listing."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_evict import __main__ as cli
from vllm_evict.listing import format_policies
from vllm_evict.policies import BASE_POLICIES, META_POLICIES

REPO = Path(__file__).resolve().parents[1]


def check_listing(text: str) -> None:
    firsts = [line.split()[0] for line in text.splitlines() if line.strip()]
    for name in BASE_POLICIES:
        assert firsts.count(name) == 1, f"{name} should be listed on exactly one line:\n{text}"
    for name in META_POLICIES:
        assert firsts.count(f"{name}+BASE") == 1, f"{name}+BASE should be listed on exactly one line:\n{text}"
    for line in text.splitlines():
        if line.split() and line.split()[0] in BASE_POLICIES:
            assert len(line.split()) > 1, f"no summary on {line!r}"


def test_python_m_vllm_evict_policies_lists_every_method():
    result = subprocess.run([sys.executable, "-m", "vllm_evict", "policies"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    check_listing(result.stdout)


def test_meta_lines_name_their_valid_bases():
    lines = {line.split()[0]: line for line in format_policies().splitlines() if line.strip()}
    for meta in META_POLICIES:
        line = lines[f"{meta}+BASE"]
        bases = line.rsplit("(bases: ", 1)[1].rstrip(")").split(", ")
        assert {"snapkv", "h2o", "tova"} <= set(bases)
        assert not {"keydiff", "streamingllm", "knorm", "random"} & set(bases)


def test_in_process_dispatch(capsys):
    assert cli.main(["policies"]) == 0
    check_listing(capsys.readouterr().out)


def test_every_command_resolves_to_a_function():
    for name, target in cli.COMMANDS.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_arguments_after_the_command_go_to_the_command(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["policies", "--help"])
    assert info.value.code == 0
    assert "python -m vllm_evict policies" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        cli.main(["policies", "--bogus"])
    assert info.value.code == 2


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--nope"]])
def test_missing_or_unknown_command_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert "usage: python -m vllm_evict" in capsys.readouterr().err
