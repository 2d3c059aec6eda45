"""Fixtures for the scale-out tests: tiny random Llamas whose KV heads split over two ranks, or not."""

from __future__ import annotations

from typing import Callable

import pytest

pytest.importorskip("vllm", reason="the scale-out tests need vLLM (make install)")

from tests.scaleout.helpers import (KV_HEADS, POLICIES, Outcome, requests_for, run_requests,  # noqa: E402
                                    start_engine, stop_engine)
from vllm_evict.testing import build_tiny_llama  # noqa: E402

# Weights 10x the default spread: attention is peaked (entropy ~1 nat over 256 tokens, vs uniform at 0.02),
# so scores follow content rather than token age, and greedy tokens vary instead of repeating one id.
INIT_STD = 0.2


@pytest.fixture(scope="session")
def llama_kv4(tmp_path_factory: pytest.TempPathFactory) -> str:
    """8 query heads over 4 KV heads: under TP 2 each rank holds 2 whole GQA groups."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("llama-kv4"), heads=8, kv_heads=4, init_std=INIT_STD))


@pytest.fixture(scope="session")
def llama_kv1(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 query heads over 1 KV head: under TP 2 the KV head is replicated and each rank holds half its group."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("llama-kv1"), heads=4, kv_heads=1, init_std=INIT_STD))


@pytest.fixture(scope="session")
def tp_outcomes(request: pytest.FixtureRequest) -> Callable[[str, int], dict[str, Outcome]]:
    """(model, tp) -> {method: Outcome}: one engine run per pair, made the first time it is asked for.

    Every run serves the same batch, one request per method (``helpers.requests_for(POLICIES)``), and
    checks that the pool is full again after the drain."""
    cache: dict[tuple[str, int], dict[str, Outcome]] = {}

    def get(model: str, tp: int) -> dict[str, Outcome]:
        if (model, tp) not in cache:
            engine = start_engine(request.getfixturevalue(f"llama_{model}"), tp=tp, kv_heads=KV_HEADS[model])
            try:
                outcomes = run_requests(engine, requests_for(POLICIES))
                assert engine.free_pages() == engine.total_pages(), f"{model} TP {tp}: pages not returned after drain"
                assert not engine.scheduler.evicted and not engine.scheduler.pending_keep
            finally:
                stop_engine(engine)
            cache[(model, tp)] = outcomes
        return cache[(model, tp)]

    return get

