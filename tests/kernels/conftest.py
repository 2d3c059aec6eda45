"""Kernel tests: every backend of every ``vllm_evict.ops`` operation against its PyTorch reference
(vllm_evict/paged.py, vllm_evict/dense.py).

Without a GPU the Triton kernels run in the Triton interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when a kernel is decorated, i.e. when vllm_evict.kernels.* is first imported, so it is
set here (and in tests/conftest.py), before any test module imports them. With a GPU the same tests
also run on CUDA tensors, and the CUDA kernels join the backends where the extension builds.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    return torch.device(request.param)


def _cuda_ready(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("the CUDA kernels need a CUDA device")
    from vllm_evict import csrc

    if csrc.load_extension() is None:
        pytest.skip(f"CUDA extension not built: {csrc.load_error()}")


@pytest.fixture(params=["torch", "triton", "cuda"])
def backend(request, device) -> str:
    """Every backend of an op with a CUDA kernel: the PyTorch reference through the dispatch, Triton
    (the interpreter on CPU) and CUDA (GPUs only)."""
    if request.param == "cuda":
        _cuda_ready(device)
    return request.param


@pytest.fixture(params=["torch", "triton"])
def triton_backend(request) -> str:
    """Every backend of an op without a CUDA kernel."""
    return request.param


@pytest.fixture(params=["triton", "cuda"])
def kernel_backend(request, device) -> str:
    """The compiled backends of an op with a CUDA kernel (for arguments the PyTorch reference does not
    take as they are, e.g. int32 or non-contiguous index tensors)."""
    if request.param == "cuda":
        _cuda_ready(device)
    return request.param
