"""The policies' heavy score arithmetic, read straight from the engine's paged KV cache.

``PagedScoreKernels`` is what the model-runner mixin puts in ``EvictionInputs.kernels`` for one
(request, layer): each method calls the matching ``vllm_evict.ops`` dispatch function (the PyTorch
reference on CPU, Triton or CUDA on a GPU) on the cache pages through the request's block ids, so
no K or V is gathered into a dense copy for it. Policies cannot tell it from the dense reference
``ScoreKernels`` except by speed; tests/engine/test_paged_kernels.py checks that they agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from vllm_evict import ops
from vllm_evict.policies.kernels import ScoreKernels

if TYPE_CHECKING:
    from vllm_evict.policies.base import EvictionInputs


@dataclass
class PagedScoreKernels(ScoreKernels):
    """One request's slots ``0..length-1`` of one layer, in the pages ``block_ids``."""

    k_cache: Tensor  # [num_blocks, H_kv, block_size, d] view (any strides)
    v_cache: Tensor
    positions: Tensor  # int64 [num_blocks, H_kv, block_size]: logical position of every slot
    block_ids: Tensor  # int64 [pages]
    length: int  # physical tokens the request has in cache, this step's included
    new_start: int = 0  # first slot of this step's tokens (CriticalKV computes their nu)
    # name -> the layer's paged per-token state buffer fp32 [num_blocks, H_kv, block_size]
    state_buffer: Callable[[str], Tensor] | None = None
    backend: str | None = None  # None: ops picks by device; tests force "torch" or "triton"

    def _lengths(self, length: int | None = None) -> Tensor:
        return torch.tensor([self.length if length is None else length], dtype=torch.int64,
                            device=self.k_cache.device)

    def column_sums(self, inp: "EvictionInputs", queries: Tensor, query_positions: Tensor,
                    gain: Tensor | float = 1.0, per_query_head: bool = False) -> Tensor:
        w = queries.shape[1]
        if w == 0:
            shape = (self.k_cache.shape[1], queries.shape[0] // self.k_cache.shape[1]) if per_query_head else \
                (self.k_cache.shape[1],)
            return torch.zeros(*shape, self.length, dtype=torch.float32, device=self.k_cache.device)
        device = self.k_cache.device
        gains = None
        if not (isinstance(gain, (int, float)) and gain == 1.0):
            gains = torch.as_tensor(gain, dtype=torch.float32, device=device).expand(w).contiguous()
        sums = ops.window_attention_mass(
            self.k_cache, self.block_ids.unsqueeze(0), self._lengths(),
            queries.transpose(0, 1).to(self.k_cache.dtype).contiguous(),  # packed rows [w, H_q, d]
            torch.tensor([0, w], dtype=torch.int64, device=device), query_positions.to(device, torch.int64),
            inp.scale, positions=self.positions, gain=gains, reduce_group=not per_query_head,
            max_len=self.length, backend=self.backend)
        return sums[0]

    def keydiff_scores(self, inp: "EvictionInputs") -> Tensor:
        return ops.keydiff_scores(self.k_cache, self.block_ids.unsqueeze(0), self._lengths(),
                                  max_len=self.length, backend=self.backend)[0]

    def value_error(self, inp: "EvictionInputs", alpha: Tensor, fast: bool, eps: float) -> Tensor:
        return ops.caote_scores(self.v_cache, self.block_ids.unsqueeze(0), self._lengths(), alpha.unsqueeze(0),
                                fast=fast, eps=eps, backend=self.backend)[0]

    def projected_value_norms(self, new_values: Tensor, o_proj: Tensor | None, state_name: str) -> Tensor:
        """nu of this step's tokens, computed from their values already in the cache and written into
        the state buffer ``state_name``; returned too, so the caller's ordinary state write stays uniform."""
        if self.state_buffer is None or o_proj is None:
            return super().projected_value_norms(new_values, o_proj, state_name)
        device = self.v_cache.device
        buffer = self.state_buffer(state_name)
        ops.criticalkv_value_norms(
            self.v_cache, self.block_ids.unsqueeze(0), torch.tensor([self.new_start], device=device),
            torch.tensor([self.length], device=device), o_proj, buffer, backend=self.backend)
        slots = torch.arange(self.new_start, self.length, device=buffer.device)
        page = buffer.shape[2]
        return buffer[self.block_ids[slots // page], :, slots % page].transpose(0, 1)  # [H_kv, m]
