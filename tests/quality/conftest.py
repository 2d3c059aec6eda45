"""The quality tests' engine: one ``vllm.LLM`` for the package (SmolLM2-135M-Instruct, float32, the suite's
engine set-up), shared by the suite-runner tests and the kept-token regression test."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from benchmarks.quality import engine_runner as E
from tests.quality.kept_golden import CHUNK


@pytest.fixture(scope="package")
def llm(smollm2_path) -> Iterator[Any]:
    built = E.make_llm(str(smollm2_path), dtype="float32", max_model_len=1024, chunk=CHUNK, max_num_seqs=8,
                       kv_bytes=1 << 28)
    yield built
    built.llm_engine.engine_core.shutdown()
