"""CUDA C++ sources of the eviction kernels (package data), their build flags and their JIT loader.

``evict_kernels.cu`` holds the kernels and includes no torch header, so it compiles with plain nvcc;
``binding.cpp`` is the torch extension. One function, ``build_flags``, says how both are compiled; the
loader and CI's build check (``python -m vllm_evict.csrc``, ``make gpu-build``) both use it.

Architectures: ``load_extension()`` builds for the compute capabilities of the visible devices, each
only if the installed nvcc can target it (``nvcc --list-gpu-arch``; nvcc 13 dropped compute_70 and
older). The flags name them explicitly (``-gencode``), so ``TORCH_CUDA_ARCH_LIST`` does not apply: a
list holding an architecture nvcc rejects cannot break the build. When a device's architecture is not
supported the reason is kept (``load_error()``) and the worker logs it at start-up with the kernels
each operation then uses (``vllm_evict.ops.describe``).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterable

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_SOURCE = SOURCE_DIR / "evict_kernels.cu"
BINDING_SOURCE = SOURCE_DIR / "binding.cpp"
EXTENSION_NAME = "vllm_evict_cuda"
CXX_FLAGS = ("-O3",)
NVCC_FLAGS = ("-O3", "--use_fast_math")

_module: Any = None
_error: str | None = None
_tried = False


def _arch_number(arch: str) -> int:
    """'9.0' or '90' -> 90."""
    text = str(arch).strip()
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major) * 10 + int(minor[:1] or 0)
    return int(text)


def arch_flags(archs: Iterable[str]) -> list[str]:
    """nvcc flags generating native code (SASS) for each compute capability ('8.0', '9.0', ...)."""
    numbers = sorted({_arch_number(a) for a in archs})
    if not numbers:
        raise ValueError("no CUDA architecture to build for")
    return [f"-gencode=arch=compute_{n},code=sm_{n}" for n in numbers]


def build_flags(archs: Iterable[str]) -> dict[str, list[str]]:
    """The ``torch.utils.cpp_extension.load`` arguments that differ between builds: the C++ and nvcc
    flags for ``archs``. The one place the flags are written down."""
    return {"extra_cflags": list(CXX_FLAGS), "extra_cuda_cflags": [*NVCC_FLAGS, *arch_flags(archs)]}


def nvcc_path() -> str | None:
    """The nvcc to build with: ``$CUDA_HOME/bin/nvcc`` (or ``CUDA_PATH``), else the one on ``PATH``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.lru_cache(maxsize=None)
def cuda_home() -> str | None:
    """The CUDA toolkit's root (``bin/nvcc``, ``include/cuda_runtime.h``). torch guesses it as the parent
    of nvcc's folder, which is wrong for a wrapper script such as /usr/local/bin/nvcc; nvcc itself says
    where it lives (``TOP`` in ``nvcc --dryrun``)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    guess = Path(nvcc).resolve().parent.parent
    if (guess / "include" / "cuda_runtime.h").exists():
        return str(guess)
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", "-o", os.devnull, os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    return str(Path(top.group(1).strip()).resolve()) if top else None


@functools.lru_cache(maxsize=None)
def nvcc_archs(nvcc: str | None = None) -> tuple[int, ...]:
    """Compute capabilities (e.g. 75, 80, 90) the installed nvcc compiles for, from
    ``nvcc --list-gpu-arch``; empty when there is no nvcc."""
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        return ()
    try:
        listing = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(sorted({int(m) for m in re.findall(r"compute_(\d+)", listing)}))


def supported_archs(wanted: Iterable[str | int], available: Iterable[int]) -> tuple[list[str], list[str]]:
    """(archs to build, archs nvcc cannot target) among ``wanted``, as 'major.minor' strings."""
    have = set(available)
    build, missing = [], []
    for arch in sorted({_arch_number(str(a)) for a in wanted}):
        (build if arch in have else missing).append(f"{arch // 10}.{arch % 10}")
    return build, missing


def compile_extension(archs: Iterable[str], *, build_directory: str | None = None, verbose: bool = False) -> Any:
    """Build (or load the cached build of) the extension for ``archs`` and import it. Raises on failure.

    Needs no GPU: CI runs it to check the sources compile for sm_80 and sm_90 with the loader's flags."""
    from torch.utils import cpp_extension

    home = cuda_home()
    if home is not None and os.environ.get("CUDA_HOME") is None:
        os.environ["CUDA_HOME"] = home
        cpp_extension.CUDA_HOME = home  # read at build time; torch computed it when first imported
    if build_directory is not None:
        Path(build_directory).mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name=EXTENSION_NAME, sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
                              extra_include_paths=[str(SOURCE_DIR)], build_directory=build_directory,
                              verbose=verbose, **build_flags(archs))


def device_archs() -> list[str]:
    """Compute capabilities of the visible CUDA devices, 'major.minor'."""
    import torch

    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return [f"{major}.{minor}" for major, minor in sorted(caps)]


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

        if not torch.cuda.is_available() or torch.version.cuda is None:
            _error = "torch has no usable CUDA device/runtime"
            return None
        if nvcc_path() is None:
            _error = "no nvcc found (set CUDA_HOME or put nvcc on PATH)"
            return None
        build, missing = supported_archs(device_archs(), nvcc_archs())
        if missing:
            _error = (f"nvcc ({nvcc_path()}) cannot compile for compute capability {', '.join(missing)} of the "
                      f"visible devices; it supports {', '.join(str(a) for a in nvcc_archs()) or 'none'}")
            return None
        _module = compile_extension(build, verbose=verbose)
    except Exception as exc:  # a failed JIT build must not take the engine down: Triton takes over
        _error = f"{type(exc).__name__}: {exc}"
        _module = None
    return _module


def load_error() -> str | None:
    return _error
