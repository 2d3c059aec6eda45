"""Fused Triton kernels over the paged KV cache (installed as ``vllm_evict.kernels``).

Each module holds one operation: a ``@triton.jit`` kernel and a launcher taking the same arguments as
its PyTorch reference in ``vllm_evict/paged.py``. Nothing here is imported by ``vllm_evict`` unless a
Triton backend is picked (``vllm_evict/ops.py``), so the package works where Triton is absent.
"""
