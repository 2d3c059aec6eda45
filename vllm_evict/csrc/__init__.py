"""CUDA C++ sources of the eviction kernels (package data) and their JIT loader.

``evict_kernels.cu`` holds the kernels and includes no torch header, so it compiles with plain nvcc;
``binding.cpp`` is the torch extension. ``load_extension()`` builds both with
``torch.utils.cpp_extension.load`` the first time it is called on a machine with CUDA and returns the
module, or None (with ``load_error()`` saying why) when it cannot be built here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_SOURCE = SOURCE_DIR / "evict_kernels.cu"
BINDING_SOURCE = SOURCE_DIR / "binding.cpp"
EXTENSION_NAME = "vllm_evict_cuda"

_module: Any = None
_error: str | None = None
_tried = False


def load_extension(verbose: bool = False) -> Any:
    """The compiled extension (module with ``compact_`` and ``window_mass``), or None."""
    global _module, _error, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("VLLM_EVICT_DISABLE_CUDA_EXT", "0") == "1":
        _error = "disabled by VLLM_EVICT_DISABLE_CUDA_EXT=1"
        return None
    try:
        import torch
        from torch.utils import cpp_extension

        if not torch.cuda.is_available() or torch.version.cuda is None:
            _error = "torch has no usable CUDA device/runtime"
            return None
        _module = cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "--use_fast_math"],
            verbose=verbose,
        )
    except Exception as exc:  # a failed JIT build must not take the engine down: Triton takes over
        _error = f"{type(exc).__name__}: {exc}"
        _module = None
    return _module


def load_error() -> str | None:
    return _error
