"""Fixtures for tests that run the real vLLM V1 engine on CPU, in process."""

from __future__ import annotations

import gc
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="the engine tests need vLLM (make install)")

from tests.engine.helpers import Engine, make_llm  # noqa: E402
from vllm_evict.testing import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def engine_factory() -> Iterator[Any]:
    made: list[Engine] = []

    def factory(*args: Any, **kwargs: Any) -> Engine:
        engine = Engine(make_llm(*args, **kwargs))
        made.append(engine)
        return engine

    yield factory
    for engine in made:
        engine.llm.llm_engine.engine_core.shutdown()
    made.clear()
    gc.collect()
