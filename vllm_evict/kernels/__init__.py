"""Fused Triton kernels over the paged KV cache (installed as ``vllm_evict.kernels``).

One module per operation of ``vllm_evict/ops.py``, named after it, each holding its ``@triton.jit``
kernels and a launcher of the same name taking exactly the arguments of the dispatch call:
``compact.compact_tokens``, ``window_mass.window_mass``, ``keydiff.keydiff_scores``,
``output_error.output_error`` and ``value_norms.value_norms``. They compute what the PyTorch references
in ``vllm_evict/paged.py`` and ``vllm_evict/dense.py`` compute, read every tensor through its strides,
and never synchronise with the host: every grid size comes from a shape or a host int (``width``).
Nothing here is imported by ``vllm_evict`` unless a Triton backend is picked, so the package works
where Triton is absent.
"""
