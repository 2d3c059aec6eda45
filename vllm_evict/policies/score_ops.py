"""Where a policy's heavy score arithmetic runs, behind one small interface.

A policy asks ``inp.ops`` for the expensive quantities instead of computing them from ``inp.keys`` /
``inp.values`` itself. ``ScoreOps`` computes them from the dense tensors of ``EvictionInputs`` with the
reference math of ``vllm_evict.dense``; the engine's ``PagedScoreOps`` (vllm_evict/paged_ops.py) reads
its paged KV cache in place through the ``vllm_evict.ops`` dispatch (PyTorch, Triton or CUDA), so a
policy whose arithmetic is covered here never makes the engine gather K and V. Method names are the
quantities' names in ``vllm_evict.dense``, ``vllm_evict.ops`` and the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from vllm_evict import dense

if TYPE_CHECKING:
    from vllm_evict.policies.base import EvictionInputs


class ScoreOps:
    """Dense reference: every method reads the candidates from ``inp.keys`` / ``inp.values``."""

    def window_mass(self, inp: "EvictionInputs", query_positions: Tensor | None = None,
                    gain: Tensor | float | None = None, per_query_head: bool = False) -> Tensor:
        """``dense.window_mass`` of the inputs' window queries (``query_positions``: the inputs' own, or
        a copy with some entries emptied, see ``dense.latest_queries``): [R, H, N] or [R, H, G, N]."""
        qpos = inp.query_positions if query_positions is None else query_positions
        return dense.window_mass(inp.keys, inp.positions, inp.lengths, inp.queries, qpos, inp.scale,
                                 gain=gain, per_query_head=per_query_head)

    def keydiff_scores(self, inp: "EvictionInputs") -> Tensor:
        """``dense.keydiff_scores`` of the candidates: [R, H, N], -inf on padding."""
        return dense.keydiff_scores(inp.keys, inp.lengths)

    def output_error(self, inp: "EvictionInputs", alpha: Tensor, fast: bool, eps: float) -> Tensor:
        """``dense.output_error`` for weights ``alpha`` [R, H, N]: [R, H, N], -inf on padding."""
        return dense.output_error(alpha, inp.values, inp.lengths, fast=fast, eps=eps)

    def sum_over_layer(self, partial: Tensor) -> Tensor:
        """A quantity summed over these KV heads -> summed over every KV head of the layer (tensor
        parallel: over every rank); the dense reference holds the whole layer."""
        return partial

    def value_norms(self, values: Tensor, o_proj: Tensor) -> Tensor:
        """``dense.value_norms`` of tokens entering the cache: values [H, T, d] -> [H, T]."""
        return dense.value_norms(values, o_proj)


DENSE = ScoreOps()
