"""The tensors eviction keeps next to vLLM's KV cache, for every hooked layer at once.

- ``positions`` int32 [L, num_pages, H_kv, bs]: the logical position of every slot (RoPE stays
  logical while compaction moves tokens to other slots);
- ``states[name]`` fp32 [L, num_pages, H_kv, bs]: per-token policy state (H2O's accumulated
  attention, CriticalKV's projected value norms, ...), paged exactly like K and V;
- ``ring`` [L, slots, W, H_q, d] (model dtype): the last W queries of every running request, one slot
  each (engine/rows.py hands them out), for policies with an observation window, and
  ``ring_positions`` int64 [slots, W] (-1: empty).

One tensor across layers, so that what is the same for every layer (a new token's position, a state
that starts at 0) is written once per step. ``token_bytes`` / ``ring_bytes`` let the worker count
them in the KV-cache memory budget before vLLM sizes the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_evict.evict_step import POSITION_DTYPE
from vllm_evict.policies.base import Policy

EMPTY = -1


@dataclass(frozen=True)
class Geometry:
    layers: int
    num_pages: int
    kv_heads: int
    page_size: int
    query_heads: int
    head_size: int
    max_rows: int
    dtype: torch.dtype  # the KV cache's (and the ring's) dtype
    device: torch.device


MAX_STATES = 3  # the most per-token states any policy keeps (criticalkv+ahakv: vnorm, score, nu)


def token_bytes(layers: int, kv_heads: int, num_states: int) -> int:
    """Bytes of positions and ``num_states`` fp32 states per cached token, over all layers and KV heads."""
    return layers * kv_heads * (torch.tensor([], dtype=POSITION_DTYPE).element_size() + 4 * num_states)


def ring_bytes(layers: int, rows: int, window: int, query_heads: int, head_size: int, element: int) -> int:
    """Bytes of a ``window``-query ring for ``rows`` requests and its positions."""
    return rows * window * (layers * query_heads * head_size * element + 8)


class EvictionBuffers:
    def __init__(self, geometry: Geometry) -> None:
        g = self.geometry = geometry
        self.positions = torch.zeros(g.layers, g.num_pages, g.kv_heads, g.page_size, dtype=POSITION_DTYPE,
                                     device=g.device)
        self.states: dict[str, Tensor] = {}
        self.window = 0
        self.ring: Tensor | None = None
        self.ring_positions: Tensor | None = None

    def ensure_policy(self, policy: Policy, budget: int | None = None) -> bool:
        """Allocate what ``policy`` needs at ``budget`` (its states, a ring as wide as its window there);
        True if anything new."""
        g = self.geometry
        changed = False
        for name in policy.state_names:
            if name not in self.states:
                self.states[name] = torch.zeros(g.layers, g.num_pages, g.kv_heads, g.page_size,
                                                dtype=torch.float32, device=g.device)
                changed = True
        window = policy.window_for(budget)
        if window > self.window:
            self._grow_ring(window)
            changed = True
        return changed

    def _grow_ring(self, window: int) -> None:
        """A wider ring (a request with a wider window arrived); every stored query moves to its entry
        in the new ring (position % W), so running requests keep their windows."""
        g = self.geometry
        ring = torch.zeros(g.layers, g.max_rows, window, g.query_heads, g.head_size, dtype=g.dtype,
                           device=g.device)
        positions = torch.full((g.max_rows, window), EMPTY, dtype=torch.int64, device=g.device)
        if self.ring is not None and self.ring_positions is not None:
            old = self.ring_positions
            rows = torch.arange(g.max_rows, device=g.device).view(-1, 1).expand_as(old)
            stored = old >= 0
            target = (rows * window + old.remainder(window))[stored]
            ring.view(g.layers, -1, g.query_heads, g.head_size)[:, target] = self.ring[:, stored]
            positions.view(-1)[target] = old[stored]
        self.ring, self.ring_positions, self.window = ring, positions, window

    def reset_slot(self, slot: int) -> None:
        """A request takes ``slot`` of the ring: it starts with no queries."""
        if self.ring_positions is not None:
            self.ring_positions[slot].fill_(EMPTY)
