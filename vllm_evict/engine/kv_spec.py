"""Page accounting for requests whose cache shrinks, on vLLM's public KV-cache spec registry.

vLLM sizes a request's pages from its logical length (``num_computed_tokens`` and the tokens scheduled);
after eviction a request holds fewer tokens than that. ``EvictingAttentionSpec`` is vLLM's
``FullAttentionSpec`` under another class, which the workers report for every layer
(``evicting_specs``, called from the evicting worker's ``get_kv_cache_spec``); vLLM's registry
(``vllm/v1/kv_cache_spec_registry.py``, made for out-of-tree specs) maps it to
``EvictingAttentionManager``, vLLM's ``FullAttentionManager`` that knows, per request, how many tokens
eviction has removed (``evicted``) and sizes pages from the physical length. The grouping, the page size
and the attention backends see a ``FullAttentionSpec`` (the registry groups the two as one type).

The scheduler decides what a request keeps (engine/scheduler.py) and calls ``release_tail`` once the
workers have compacted; what no public hook offers (admission under a budget, prefix sharing, the plan
handed to the workers) stays in the scheduler subclass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """Full attention whose per-request length may shrink: same layout and page size as its base."""


class EvictingAttentionManager(FullAttentionManager):
    """vLLM's full-attention page manager, sized by what each request physically holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evicted: dict[str, int] = {}  # request id -> logical - physical tokens (absent: 0)

    # vLLM passes the logical length (tokens that need a slot, cached ones included); the pages a request
    # needs follow from the tokens it holds.
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        return super().get_num_blocks_to_allocate(request_id, num_tokens - self.evicted.get(request_id, 0),
                                                  *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        evicted = self.evicted.get(request_id, 0)
        return super().allocate_new_blocks(request_id, num_tokens - evicted, num_tokens_main_model - evicted)

    def release_tail(self, request_id: str, keep_pages: int, evicted: int) -> int:
        """Keep ``request_id``'s first ``keep_pages`` pages and give the rest back to the pool; its cache
        is now ``evicted`` tokens shorter than its logical length. Returns the pages given back."""
        blocks = self.req_to_blocks[request_id]
        tail = blocks[keep_pages:]
        del blocks[keep_pages:]
        self.block_pool.free_blocks(reversed(tail))  # the last page first: reused last, as vLLM frees
        self.evicted[request_id] = evicted
        return len(tail)

    def free(self, request_id: str) -> None:
        # A finished or preempted request: vLLM frees all its pages; a recompute starts from token 0.
        super().free(request_id)
        self.evicted.pop(request_id, None)


def register() -> None:
    """Put the spec and its manager in vLLM's registry (in every process that reads specs: the workers,
    which check their own, and the engine core, which groups them and builds the managers).

    vLLM registers its built-in specs lazily, and only into an empty registry, so they go in first; every
    registration is idempotent (vLLM asserts a repeated one is identical)."""
    register_all_kvcache_specs(None)
    KVCacheSpecRegistry.register(EvictingAttentionSpec, EvictingAttentionManager,
                                 uniform_type_base_spec=FullAttentionSpec)


def evicting_specs(specs: dict[str, Any]) -> dict[str, Any]:
    """The worker's per-layer specs with every full-attention layer as ``EvictingAttentionSpec``."""
    register()
    return {name: _evicting(spec) if type(spec) is FullAttentionSpec else spec for name, spec in specs.items()}


def _evicting(spec: FullAttentionSpec) -> EvictingAttentionSpec:
    return EvictingAttentionSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init})


# The engine core unpickles the workers' specs, which imports this module: registered before vLLM groups them.
register()
