"""Kernel tests: every Triton kernel against its PyTorch reference (vllm_evict/paged.py).

Without a GPU the Triton kernels run in the Triton interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when a kernel is decorated, i.e. when vllm_evict.kernels.* is first imported, so it is
set here, before any test module imports them. With a GPU the same tests also run on CUDA tensors.
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


@pytest.fixture(params=["triton", "cuda"])
def kernel_backend(request, device) -> str:
    """Backends with a compiled kernel: Triton everywhere (interpreter on CPU), CUDA on GPUs."""
    if request.param == "cuda":
        if device.type != "cuda":
            pytest.skip("the CUDA kernels need a CUDA device")
        from vllm_evict import csrc

        if csrc.load_extension() is None:
            pytest.skip(f"CUDA extension not built: {csrc.load_error()}")
    return request.param
