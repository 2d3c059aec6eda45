"""The policies' heavy score arithmetic read straight from a paged KV cache.

``PagedScoreOps`` is what the eviction step (``vllm_evict.evict_step``) puts in
``EvictionInputs.ops`` for one group of rows of one layer: each method calls the matching
``vllm_evict.ops`` dispatch function (the PyTorch reference on CPU, Triton or CUDA on a GPU) on the
cache pages through the rows' block table, so no K or V is gathered into a dense copy for it.
Policies cannot tell it from the dense reference ``ScoreOps`` except by speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from vllm_evict import ops
from vllm_evict.policies.score_ops import ScoreOps

if TYPE_CHECKING:
    from vllm_evict.policies.base import EvictionInputs


class DispatchedScoreOps(ScoreOps):
    """The dense reference, except that per-token arithmetic goes through the ``ops`` dispatch."""

    def value_norms(self, values: Tensor, o_proj: Tensor) -> Tensor:
        return ops.value_norms(values, o_proj)


DISPATCHED = DispatchedScoreOps()


@dataclass
class PagedScoreOps(DispatchedScoreOps):
    """Rows ``block_table`` [R, pages] of one layer's paged cache, ``lengths`` [R] slots each."""

    k_cache: Tensor  # [num_pages, H_kv, bs, d] view (any strides)
    v_cache: Tensor
    positions: Tensor  # int32 [num_pages, H_kv, bs]: logical position of every slot
    block_table: Tensor  # [R, pages]
    lengths: Tensor  # int64 [R]
    width: int  # N, the padded candidate axis (a host int)
    backend: str | None = None  # None: ops picks by device; tests force "torch" or "triton"

    def window_mass(self, inp: "EvictionInputs", query_positions: Tensor | None = None,
                    gain: Tensor | float | None = None, per_query_head: bool = False) -> Tensor:
        qpos = inp.query_positions if query_positions is None else query_positions
        rows, w = qpos.shape
        gains = None
        if gain is not None and not (isinstance(gain, (int, float)) and gain == 1.0):
            from vllm_evict.dense import row_gains

            gains = row_gains(gain, rows, w, self.k_cache.device).contiguous()
        queries = inp.queries.permute(0, 2, 1, 3).to(self.k_cache.dtype)  # [R, W, H_q, d]
        return ops.window_mass(self.k_cache, self.block_table, self.lengths, queries, qpos, inp.scale,
                               positions=self.positions, width=self.width, gain=gains,
                               per_query_head=per_query_head, backend=self.backend)

    def keydiff_scores(self, inp: "EvictionInputs") -> Tensor:
        return ops.keydiff_scores(self.k_cache, self.block_table, self.lengths, width=self.width,
                                  backend=self.backend)

    def output_error(self, inp: "EvictionInputs", alpha: Tensor, fast: bool, eps: float) -> Tensor:
        return ops.output_error(self.v_cache, self.block_table, self.lengths, alpha, fast=fast, eps=eps,
                                backend=self.backend)
