"""The policies' heavy score arithmetic read straight from a paged KV cache.

``PagedScoreOps`` is what the eviction step (``vllm_evict.evict_step``) puts in
``EvictionInputs.ops`` for one group of rows of one layer: each method calls the matching
``vllm_evict.ops`` dispatch function (the PyTorch reference on CPU, Triton or CUDA on a GPU) on the
cache pages through the rows' block table, so no K or V is gathered into a dense copy for it.
Policies cannot tell it from the dense reference ``ScoreOps`` except by speed.

Under tensor parallelism with replicated KV heads (``shard.kv_replicas > 1``) a rank holds only part
of each KV head's query-head group: the two sums over a group (``window_mass``, ``value_norms``) are
completed across the copies by ``vllm_evict.kv_shard.KVShard`` (one all-reduce per call), so every
copy returns what one rank holding the whole group would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from vllm_evict import ops
from vllm_evict.kv_shard import KVShard
from vllm_evict.policies.score_ops import ScoreOps

if TYPE_CHECKING:
    from vllm_evict.policies.base import EvictionInputs


class DispatchedScoreOps(ScoreOps):
    """The dense reference, except that per-token arithmetic goes through the ``ops`` dispatch; sums over
    a query-head group are completed over the ``shard``'s copies (None: the rank holds whole groups)."""

    shard: KVShard | None = None

    def __init__(self, shard: KVShard | None = None) -> None:
        self.shard = shard

    def sum_over_layer(self, partial: Tensor) -> Tensor:
        return partial if self.shard is None else self.shard.sum_over_layer(partial)

    def value_norms(self, values: Tensor, o_proj: Tensor) -> Tensor:
        nu = ops.value_norms(values, o_proj)
        return nu if self.shard is None else self.shard.complete_value_norms(nu)


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
    shard: KVShard | None = None  # tensor parallel: this rank's KV heads (None: whole groups)
    k_scale: Tensor | None = None  # an fp8 cache's per-layer scales (the kernels dequantise with them)
    v_scale: Tensor | None = None

    def window_mass(self, inp: "EvictionInputs", query_positions: Tensor | None = None,
                    gain: Tensor | float | None = None, per_query_head: bool = False) -> Tensor:
        qpos = inp.query_positions if query_positions is None else query_positions
        rows, w = qpos.shape
        gains = None
        if gain is not None and not (isinstance(gain, (int, float)) and gain == 1.0):
            from vllm_evict.dense import row_gains

            gains = row_gains(gain, rows, w, self.k_cache.device).contiguous()
        queries = inp.queries.permute(0, 2, 1, 3)  # [R, W, H_q, d]
        if self.k_scale is None:  # over an fp8 cache the queries keep their dtype
            queries = queries.to(self.k_cache.dtype)
        mass = ops.window_mass(self.k_cache, self.block_table, self.lengths, queries, qpos, inp.scale,
                               positions=self.positions, width=self.width, gain=gains,
                               per_query_head=per_query_head, backend=self.backend, k_scale=self.k_scale)
        if self.shard is None:
            return mass
        return self.shard.complete_group_mass(mass) if per_query_head else self.shard.complete_mass(mass)

    def keydiff_scores(self, inp: "EvictionInputs") -> Tensor:
        return ops.keydiff_scores(self.k_cache, self.block_table, self.lengths, width=self.width,
                                  backend=self.backend, k_scale=self.k_scale)

    def output_error(self, inp: "EvictionInputs", alpha: Tensor, fast: bool, eps: float) -> Tensor:
        return ops.output_error(self.v_cache, self.block_table, self.lengths, alpha, fast=fast, eps=eps,
                                backend=self.backend, v_scale=self.v_scale)
