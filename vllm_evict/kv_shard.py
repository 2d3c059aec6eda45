"""A rank's share of the KV heads under tensor parallelism, and how the copies of a replicated KV head
agree on its scores.

vLLM shards KV heads as ``QKVParallelLinear`` does. With ``tp <= H_kv`` rank r holds ``H_kv / tp``
whole KV heads together with all the query heads of their groups: every sum over a group is local and
nothing here does anything. With ``tp > H_kv`` each KV head is copied to ``kv_replicas = tp / H_kv``
consecutive ranks (rank r holds KV head ``r // kv_replicas``), and each copy holds only
``G / kv_replicas`` of the group's query heads, copy ``r % kv_replicas`` the slice starting at
``(r % kv_replicas) * G_local``.

Every policy reduces over a group's query heads only through ``inp.ops`` (attention column sums,
``window_mass``; CriticalKV's projected value norms, ``value_norms``), and always as a sum taken before
anything nonlinear (pooling, normalising, top-k). Completing those sums is therefore enough to make
each copy compute the same scores as one rank holding the whole group: a copy writes its partial sum
into a zero buffer laid out by *global* KV head (and global query head within the group), one
all-reduce over the whole tensor-parallel group adds the copies, and the rank reads back its own
entries. Ranks holding different KV heads write disjoint entries, so one all-reduce over the whole
group is exact whatever the sharding.

Every rank must issue the same collectives in the same order, or the group deadlocks: the all-reduce
runs only under conditions that are the same on every rank (``kv_replicas > 1``; the step plan's
groups, which every rank gets from the same scheduler output; the policy's code path, which depends on
the plan and the policy's options, never on a rank's data). Nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

AllReduce = Callable[[Tensor], Tensor]  # sum over every rank of the tensor-parallel group (may work in place)


@dataclass(frozen=True)
class KVShard:
    """The KV heads of one tensor-parallel rank, and the group's all-reduce."""

    total_kv_heads: int  # H_kv of the model
    local_kv_heads: int  # KV heads on this rank
    head_offset: int  # global index of this rank's first KV head
    kv_replicas: int = 1  # ranks holding a copy of each of this rank's KV heads
    replica: int = 0  # which copy this rank is (tp_rank % kv_replicas): its slice of the query-head group
    all_reduce: AllReduce | None = None  # required when there is more than one rank
    tp_size: int = 1

    @classmethod
    def of_rank(cls, tp_rank: int, tp_size: int, total_kv_heads: int, all_reduce: AllReduce | None = None
                ) -> "KVShard":
        """vLLM's sharding of ``total_kv_heads`` over ``tp_size`` ranks, seen from ``tp_rank``."""
        if tp_size <= total_kv_heads:
            if total_kv_heads % tp_size:
                raise ValueError(f"{total_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
            local = total_kv_heads // tp_size
            return cls(total_kv_heads, local, tp_rank * local, all_reduce=all_reduce, tp_size=tp_size)
        if tp_size % total_kv_heads:
            raise ValueError(f"{tp_size} tensor-parallel ranks are not a multiple of {total_kv_heads} KV heads")
        replicas = tp_size // total_kv_heads
        if all_reduce is None:
            raise ValueError("KV heads replicated over ranks need the tensor-parallel group's all-reduce")
        return cls(total_kv_heads, 1, tp_rank // replicas, replicas, tp_rank % replicas, all_reduce, tp_size)

    @property
    def replicated(self) -> bool:
        return self.kv_replicas > 1

    def _reduce_heads(self, partial: Tensor, query_axis: int | None = None) -> Tensor:
        """Scatter ``partial`` (KV heads on axis 1, local query heads on ``query_axis``) into the zero
        buffer over all global heads, all-reduce it, and read this rank's entries back."""
        assert self.all_reduce is not None
        shape = list(partial.shape)
        heads = slice(self.head_offset, self.head_offset + self.local_kv_heads)
        shape[1] = self.total_kv_heads
        index: list[slice] = [slice(None)] * len(shape)
        index[1] = heads
        if query_axis is not None:
            local = shape[query_axis]
            shape[query_axis] = local * self.kv_replicas
            index[query_axis] = slice(self.replica * local, (self.replica + 1) * local)
        buffer = partial.new_zeros(shape)
        buffer[tuple(index)] = partial
        reduced = self.all_reduce(buffer)
        return reduced[:, heads]

    def complete_mass(self, partial: Tensor) -> Tensor:
        """[R, H_local, N] summed over this rank's query heads -> summed over the whole group."""
        return self._reduce_heads(partial) if self.replicated else partial

    def complete_group_mass(self, partial: Tensor) -> Tensor:
        """[R, H_local, G_local, N] per local query head -> [R, H_local, G, N] per query head of the whole
        group, in global order."""
        return self._reduce_heads(partial, query_axis=2) if self.replicated else partial

    def sum_over_layer(self, partial: Tensor) -> Tensor:
        """A quantity summed over this rank's KV heads (each with its whole, completed group) -> summed over
        every KV head of the layer: all ranks add theirs, and each replicated head counted once. For
        methods that rank by the whole layer (TOVA's default)."""
        if self.tp_size == 1:
            return partial
        if self.all_reduce is None:
            raise ValueError("a layer-wide score over tensor-parallel ranks needs the group's all-reduce")
        total = self.all_reduce(partial.clone())
        return total / self.kv_replicas if self.replicated else total

    def complete_value_norms(self, partial: Tensor) -> Tensor:
        """[H_local, T] means over this rank's G_local query heads -> means over the whole group (the
        copies hold equally many heads, so the group mean is the mean of their means)."""
        if not self.replicated:
            return partial
        return self._reduce_heads(partial.unsqueeze(0))[0] / self.kv_replicas
