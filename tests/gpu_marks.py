"""A pytest plugin (``-p tests.gpu_marks``) for tests/test_gpu_script.py: after collection it prints, for
every collected test that would run on a CUDA device, whether it carries the ``gpu`` mark. A test runs on
CUDA when its ``device`` parameter (or fixture) is CUDA, or its source moves tensors there (``.cuda(``,
``device="cuda"``); the GPU run selects the tests to run with ``-m gpu``."""

from __future__ import annotations

import inspect
import re

import pytest

CUDA_SOURCE = re.compile(r"\.cuda\(|device=[\"']cuda|torch\.device\([\"']cuda")


def uses_cuda(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if str(params.get("device", "")).startswith("cuda"):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    return bool(CUDA_SOURCE.search(source))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if uses_cuda(item):
            print(f"CUDA-TEST {'gpu' if item.get_closest_marker('gpu') else 'UNMARKED'} {item.nodeid}")
