"""The heavy arithmetic of scoring, behind one small interface.

A policy asks ``inp.kernels`` for the expensive quantities (window attention sums, KeyDiff's key
similarity, CAOTE's value term, CriticalKV's projected-value norms) instead of computing them from
``inp.keys`` / ``inp.values`` itself. ``ScoreKernels`` below computes them from the dense tensors of
``EvictionInputs``: it is the reference, used by the policy tests and the HF reference runner. The
engine hands policies a subclass that reads its paged cache in place through ``vllm_evict.ops``
(PyTorch reference on CPU, Triton or CUDA on a GPU), so a policy whose arithmetic is covered here never
makes the engine gather K and V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from vllm_evict.policies.base import EvictionInputs


class ScoreKernels:
    """Dense reference: every method reads the candidates from ``inp.keys`` / ``inp.values``."""

    def column_sums(self, inp: "EvictionInputs", queries: Tensor, query_positions: Tensor,
                    gain: Tensor | float = 1.0, per_query_head: bool = False) -> Tensor:
        """Causal softmax column sums of ``queries`` [H_q, w, d] over the candidates, fp32:
        summed over the GQA group [H_kv, n], or [H_kv, G, n] with ``per_query_head``
        (see ``attention.attention_column_sums``)."""
        from vllm_evict.policies.attention import attention_column_sums

        sums = attention_column_sums(inp.keys, inp.positions, queries, query_positions, inp.scale, gain=gain)
        return sums if per_query_head else sums.sum(dim=1)

    def keydiff_scores(self, inp: "EvictionInputs") -> Tensor:
        """KeyDiff's −k̂ᵀμ over the candidates, fp32 [H_kv, n]."""
        from vllm_evict.policies.keydiff import keydiff_scores

        return keydiff_scores(inp.keys)

    def value_error(self, inp: "EvictionInputs", alpha: Tensor, fast: bool, eps: float) -> Tensor:
        """CAOTE's α/(1−α)·||X − v_j|| for weights ``alpha`` [H_kv, n], X = Σ α v (``fast``: mean v)."""
        from vllm_evict.policies.caote import output_error

        v = inp.values.float()
        center = v.mean(dim=1) if fast else torch.einsum("hn,hnd->hd", alpha, v)
        return output_error(alpha, v, center, eps)

    def projected_value_norms(self, new_values: Tensor, o_proj: Tensor | None, state_name: str) -> Tensor:
        """CriticalKV's ν of the tokens entering the cache, ``new_values`` [H_kv, m, d] -> [H_kv, m].

        ``state_name``: the per-token state the policy keeps ν in (a paged implementation may write it
        there directly)."""
        from vllm_evict.policies.criticalkv import projected_value_l1

        return projected_value_l1(new_values, o_proj)


DENSE = ScoreKernels()
