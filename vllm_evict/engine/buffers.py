"""The tensors eviction keeps next to vLLM's KV cache, for every hooked layer at once, all allocated at
start-up from the server's ``Reservation`` (vllm_evict/reservation.py) and counted in the KV-cache memory
before vLLM sizes its pool (``bytes_per_token`` / ``ring_bytes``):

- ``positions`` int32 [L, num_pages, H_kv, bs]: the logical position of every slot (RoPE stays
  logical while compaction moves tokens to other slots);
- ``states[name]`` fp32 [L, num_pages, H_kv, bs] (a per-query-head state: [L, num_pages, H_kv, bs, G]):
  per-token policy state (the accumulated observation-window mass, H2O's accumulated attention,
  CriticalKV's projected value norms, ...), paged exactly like K and V;
- on an elastic server, ``ring`` [L, rows, W, H_q, d] (model dtype): the last W queries of every running
  request, one slot each (engine/rows.py hands them out), since an elastic request can be compressed at
  any step; and ``ring_positions`` int64 [rows, W] (-1: empty). Fixed-mode requests keep no queries here:
  a decode window's queries wait in pages of the KV pool the scheduler lends while it has them free
  (engine/window_pages.py), and otherwise the window is accumulated into a state as its queries arrive
  (evict_step.py).

One tensor across layers, so that what is the same for every layer (a new token's position, a state
that starts at 0) is written once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor

from vllm_evict.evict_step import POSITION_DTYPE

EMPTY = -1
STATE_DTYPE = torch.float32


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

    @property
    def group(self) -> int:
        """Query heads per KV head on this rank."""
        return max(self.query_heads // self.kv_heads, 1)


@dataclass(frozen=True)
class Layout:
    """What the buffers hold: per-token states by name, per-token per-query-head states, and the ring's
    width (0: no ring). Built from the server's reservation."""

    states: tuple[str, ...] = ()
    head_states: tuple[str, ...] = ()
    ring_window: int = 0


def _size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def bytes_per_token(layers: int, kv_heads: int, group: int, layout: Layout) -> int:
    """Bytes eviction keeps per cached token, over all layers and KV heads: its position and states."""
    per_head = _size(POSITION_DTYPE) + _size(STATE_DTYPE) * (len(layout.states) + group * len(layout.head_states))
    return layers * kv_heads * per_head


def ring_bytes(layers: int, rows: int, window: int, query_heads: int, head_size: int, element: int) -> int:
    """Bytes of a ``window``-query ring for ``rows`` requests and its positions."""
    return rows * window * (layers * query_heads * head_size * element + 8)


class EvictionBuffers:
    def __init__(self, geometry: Geometry, layout: Layout) -> None:
        g = self.geometry = geometry
        self.layout = layout
        page_shape = (g.layers, g.num_pages, g.kv_heads, g.page_size)
        self.positions = torch.zeros(page_shape, dtype=POSITION_DTYPE, device=g.device)
        self.states: dict[str, Tensor] = {name: torch.zeros(page_shape, dtype=STATE_DTYPE, device=g.device)
                                          for name in layout.states}
        for name in layout.head_states:
            self.states[name] = torch.zeros(*page_shape, g.group, dtype=STATE_DTYPE, device=g.device)
        self.window = layout.ring_window
        self.ring: Tensor | None = None
        self.ring_positions: Tensor | None = None
        if self.window:
            self.ring = torch.zeros(g.layers, g.max_rows, self.window, g.query_heads, g.head_size, dtype=g.dtype,
                                    device=g.device)
            self.ring_positions = torch.full((g.max_rows, self.window), EMPTY, dtype=torch.int64, device=g.device)

    @property
    def nbytes(self) -> int:
        """Bytes held (what the start-up log reports)."""
        tensors = [self.positions, *self.states.values(), *(t for t in (self.ring, self.ring_positions) if t is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def missing(self, states: tuple[str, ...], head_states: tuple[str, ...], window: int) -> str | None:
        """What a policy needs that these buffers lack (None: nothing)."""
        absent = [n for n in states if n not in self.states] + [n for n in head_states if n not in self.states]
        if absent:
            return f"per-token state {absent[0]!r}"
        if window > self.window and self.ring is not None:
            return f"a query window of {window} (the ring holds {self.window})"
        return None

    def reset_slot(self, slot: int) -> None:
        """A request takes ``slot`` of the ring: it starts with no queries."""
        if self.ring_positions is not None:
            self.ring_positions[slot].fill_(EMPTY)


def kv_share(available: int, *, kv_per_token: int, ours_per_token: int, fixed: int) -> int:
    """The bytes of ``available`` left for K and V when eviction takes ``fixed`` bytes (the ring) plus
    ``ours_per_token`` next to every token's ``kv_per_token`` bytes of K and V."""
    return int(max(available - fixed, 0) * kv_per_token / (kv_per_token + ours_per_token))


def eviction_bytes(*, layers: int, kv_heads: int, query_heads: int, head_size: int, element: int, layout: Layout,
                   pool_tokens: int, rows: int) -> int:
    """What eviction holds next to a KV pool of ``pool_tokens`` tokens served with ``rows`` running
    requests at most: per token its positions and states, and the query ring (elastic servers)."""
    group = max(query_heads // max(kv_heads, 1), 1)
    return (pool_tokens * bytes_per_token(layers, kv_heads, group, layout)
            + ring_bytes(layers, rows, layout.ring_window, query_heads, head_size, element))


def layout_for(server: Mapping[str, Any] | None) -> Layout:
    """What the buffers of a server with eviction settings ``server`` (additional_config["kv_eviction"])
    hold: what its reservation (vllm_evict/reservation.py) says, i.e. the states of its method and of
    its ``request_policies``, and on an elastic server a query ring ``max_window``
    wide."""
    from vllm_evict.request_settings import server_settings

    settings = server_settings(server)
    if settings is None:
        return Layout()
    reservation = settings[1]
    return Layout(states=tuple(sorted(reservation.states)), head_states=tuple(sorted(reservation.head_states)),
                  ring_window=reservation.max_window if reservation.ring else 0)
