"""Fixtures for the scale-out tests: tiny random Llamas whose KV heads split over two ranks, or not."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="the scale-out tests need vLLM (make install)")

from vllm_evict.testing import build_tiny_llama  # noqa: E402

PENDING = "tp_pending"
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Cases marked ``tp_pending`` (known to fail until phase 2) stay out of the default run; they run
    only when selected by a marker expression that names them, e.g. ``-m tp_pending``."""
    if PENDING in (config.getoption("markexpr", "") or ""):
        return
    pending = [item for item in items if item.get_closest_marker(PENDING)]
    if pending:
        config.hook.pytest_deselected(items=pending)
        items[:] = [item for item in items if not item.get_closest_marker(PENDING)]
