"""Backend selection, and that the CUDA sources compile (nvcc; no GPU needed)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from vllm_evict import csrc, ops


def test_cpu_tensors_default_to_the_reference():
    assert ops.OPS == ("compact_tokens", "window_mass", "keydiff_scores", "output_error", "value_norms")
    for op in ops.OPS:
        assert ops.select_backend(op, torch.device("cpu")) == "torch"


def test_explicit_backends_are_checked():
    with pytest.raises(ValueError, match="unknown kernel backend 'tpu'; choose one of cuda, triton, torch"):
        ops.select_backend("keydiff_scores", torch.device("cpu"), backend="tpu")
    with pytest.raises(RuntimeError, match="value_norms has no CUDA kernel; CUDA kernels exist for compact_tokens, "
                                           "window_mass"):
        ops.select_backend("value_norms", torch.device("cpu"), backend="cuda")
    with pytest.raises(RuntimeError, match=r"window_mass: the CUDA kernel does not take these arguments \(device cpu\)"):
        ops.select_backend("window_mass", torch.device("cpu"), backend="cuda")
    for op in ops.OPS:
        assert ops.select_backend(op, torch.device("cpu"), backend="triton") == "triton"


def test_preference_table():
    try:
        assert ops.preferences() == {"compact_tokens": "cuda", "window_mass": "cuda", "keydiff_scores": "triton",
                                     "output_error": "triton", "value_norms": "triton"}
        ops.set_preference("window_mass", "triton")
        assert ops.preferences()["window_mass"] == "triton"
        with pytest.raises(ValueError, match="output_error has no CUDA kernel"):
            ops.set_preference("output_error", "cuda")
        with pytest.raises(ValueError, match="unknown operation 'caote_scores'; operations: compact_tokens, "):
            ops.set_preference("caote_scores", "torch")
    finally:
        ops.reset_preferences()
    assert ops.preferences()["window_mass"] == "cuda"


def test_preferences_from_the_environment(monkeypatch):
    try:
        monkeypatch.setenv("VLLM_EVICT_KERNELS", " window_mass=triton , compact_tokens=torch,")
        ops._load_env_preferences()
        assert ops.preferences()["window_mass"] == "triton" and ops.preferences()["compact_tokens"] == "torch"
        monkeypatch.setenv("VLLM_EVICT_KERNELS", "value_norms=cuda")
        with pytest.raises(ValueError, match="value_norms has no CUDA kernel"):
            ops._load_env_preferences()
    finally:
        ops.reset_preferences()


def test_every_op_has_a_triton_launcher_with_the_dispatch_signature():
    """kernels/<module>.<op> takes the parameters of the op's reference, in order (plus tile sizes)."""
    from vllm_evict import dense, paged

    modules = {"compact_tokens": "compact", "window_mass": "window_mass", "keydiff_scores": "keydiff",
               "output_error": "output_error", "value_norms": "value_norms"}
    for op in ops.OPS:
        launcher = getattr(importlib.import_module(f"vllm_evict.kernels.{modules[op]}"), op)
        reference = getattr(dense if op == "value_norms" else paged, op)
        want = list(inspect.signature(reference).parameters)
        got = list(inspect.signature(launcher).parameters)
        assert got[:len(want)] == want, (op, got, want)
        assert all(inspect.signature(launcher).parameters[p].kind == inspect.Parameter.KEYWORD_ONLY
                   for p in got[len(want):]), op


def _binding_args(name: str) -> list[str]:
    text = csrc.BINDING_SOURCE.read_text()
    start = text.index(f'm.def("{name}"')
    return re.findall(r'py::arg\("(\w+)"\)', text[start:text.index(");", start)])


def test_cuda_binding_takes_the_reference_arguments():
    """The binding's arguments are the paged reference's, in its order (per cache for compaction; the
    CUDA window mass has no per_query_head), which is how ops calls it."""
    from vllm_evict import paged

    window = list(inspect.signature(paged.window_mass).parameters)
    assert _binding_args("window_mass") == [p for p in window if p != "per_query_head"]
    assert _binding_args("compact_") == ["cache", *list(inspect.signature(paged.compact_tokens).parameters)[1:]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_cuda_extension_reports_why_it_is_missing():
    assert csrc.load_extension() is None
    assert csrc.load_error()


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    """evict_kernels.cu includes no torch header, so plain nvcc compiles it to an object file, with the
    loader's own nvcc flags (``csrc.build_flags``) for sm_80 and sm_90. (The whole extension, binding
    included, is built against the GPU build's torch by ``make gpu-ext``.)"""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    obj = tmp_path / "evict_kernels.o"
    flags = csrc.build_flags(["8.0", "9.0"])["extra_cuda_cflags"]
    cmd = [nvcc, "-c", str(csrc.KERNEL_SOURCE), "-o", str(obj), "-std=c++17", *flags, "-I", str(csrc.SOURCE_DIR),
           "-Xcompiler", "-Wall"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert obj.stat().st_size > 0
    assert "warning" not in proc.stderr.lower(), proc.stderr


@pytest.mark.slow
def test_binding_compiles_against_torch_headers(tmp_path):
    """Syntax-checks binding.cpp against torch's headers (about 40 s; opt in with
    VLLM_EVICT_CHECK_BINDING=1). A CPU torch wheel lacks the build-generated
    c10/cuda/impl/cuda_cmake_macros.h; an empty stand-in is supplied for that one file."""
    if os.environ.get("VLLM_EVICT_CHECK_BINDING", "0") != "1":
        pytest.skip("set VLLM_EVICT_CHECK_BINDING=1 to syntax-check binding.cpp (about 40 s)")
    cxx = shutil.which("g++") or shutil.which("c++")
    nvcc = _nvcc()
    if cxx is None or nvcc is None:
        pytest.skip("needs a C++ compiler and a CUDA toolkit")
    from torch.utils import cpp_extension

    roots = [Path(nvcc).resolve().parent.parent, Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")),
             Path("/usr/local/cuda")]
    cuda_include = next((r / "include" for r in roots if (r / "include" / "cuda_runtime_api.h").exists()), None)
    if cuda_include is None:
        pytest.skip("CUDA headers (cuda_runtime_api.h) not found; set CUDA_HOME")
    shim = tmp_path / "shim"
    macros = shim / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    includes = [*cpp_extension.include_paths(), str(cuda_include), sysconfig.get_paths()["include"],
                str(csrc.SOURCE_DIR)]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in includes):
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n")
        includes.append(str(shim))
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=vllm_evict_cuda", str(csrc.BINDING_SOURCE)]
    cmd += [f"-I{p}" for p in includes]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_build_flags_name_the_architectures():
    flags = csrc.build_flags(["9.0", "8.0", "90"])
    assert flags["extra_cflags"] == ["-O3"]
    assert flags["extra_cuda_cflags"] == ["-O3", "--use_fast_math", "-gencode=arch=compute_80,code=sm_80",
                                          "-gencode=arch=compute_90,code=sm_90"]
    with pytest.raises(ValueError, match="no CUDA architecture"):
        csrc.build_flags([])


def test_explicit_architectures_override_torch_cuda_arch_list(monkeypatch):
    """torch's extension builder adds arch flags from TORCH_CUDA_ARCH_LIST only when the given flags name
    none: a list holding 7.0, which nvcc 13 rejects, cannot reach the build."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.0;8.0;9.0")
    assert cpp_extension._get_cuda_arch_flags(csrc.build_flags(["9.0"])["extra_cuda_cflags"]) == []


def test_architectures_nvcc_cannot_build_are_set_aside():
    assert csrc.supported_archs(["7.0", "9.0", "8.6"], (75, 80, 86, 90, 100)) == (["8.6", "9.0"], ["7.0"])
    assert csrc.supported_archs([], (90,)) == ([], [])


def test_the_installed_nvcc_lists_its_architectures():
    if _nvcc() is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    archs = csrc.nvcc_archs(_nvcc())
    assert 90 in archs and 80 in archs, archs
    home = csrc.cuda_home()
    assert home is not None and (Path(home) / "include" / "cuda_runtime.h").exists(), home
