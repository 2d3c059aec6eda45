"""Fixtures for tests that run the real vLLM V1 engine on CPU, in process, on the model runner the suite
was started for (``VLLM_EVICT_TEST_RUNNER=v1|v2``, tests/conftest.py)."""

from __future__ import annotations

import gc
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="the engine tests need vLLM (make install)")

from tests.engine.helpers import TEST_RUNNER, Engine, make_llm, runner_kind  # noqa: E402
from vllm_evict.testing import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def engine_factory() -> Iterator[Any]:
    made: list[Engine] = []

    def factory(*args: Any, runner: str = TEST_RUNNER, **kwargs: Any) -> Engine:
        engine = Engine(make_llm(*args, **kwargs))
        made.append(engine)
        # The suite runs on the runner it was started for (VLLM_EVICT_TEST_RUNNER), or it tests nothing.
        assert runner_kind(engine.runner) == runner, f"vLLM built a {runner_kind(engine.runner)} runner, not {runner}"
        return engine

    yield factory
    for engine in made:
        engine.llm.llm_engine.engine_core.shutdown()
    made.clear()
    gc.collect()
