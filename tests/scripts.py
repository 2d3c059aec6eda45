"""Load a repository script (benchmarks/) as a module, so tests can call its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def loaded_script(relative: str, name: str) -> Iterator[ModuleType]:
    """``REPO / relative`` imported as module ``name`` (in ``sys.modules`` while the block runs: the
    script's dataclasses look their module up there while being defined)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
