"""Find how an attention backend lays out K and V inside one layer's paged cache.

The engine reads and compacts tokens through [num_blocks, H_kv, block_size, head_size] views of K and
V. Backends differ (the CPU backend stores each K tile transposed; GPU backends put heads inside a
page), so instead of assuming, the layout is probed once at start-up: random keys and values are
written through the backend's own ``do_kv_cache_update`` into the null page (page 0, which vLLM never
hands to a request), and the first candidate view that reads them back exactly is used.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

KVViews = Callable[[Tensor], tuple[Tensor, Tensor]]


def _cpu_tiles(kv: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """[NB, H, bs, 2d] storage holding a transposed [d, bs] K tile then a [bs, d] V tile per (page, head)."""
    nb, h, bs, _ = kv.shape
    flat = kv.view(nb, h, 2 * bs * head_size)
    k = flat[:, :, : bs * head_size].view(nb, h, head_size, bs).transpose(2, 3)
    v = flat[:, :, bs * head_size:].view(nb, h, bs, head_size)
    return k, v


def _stacked_tiles(kv: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """[NB, H, bs, 2d] storage holding a [bs, d] K tile then a [bs, d] V tile per (page, head)."""
    nb, h, bs, _ = kv.shape
    k, v = kv.view(nb, h, 2 * bs, head_size).chunk(2, dim=2)
    return k, v


def _split_last(kv: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """Logical [NB, H, bs, 2d] (any stride order): K and V are the two halves of the last axis."""
    k, v = kv.split(head_size, dim=-1)
    return k, v


def _stacked_nhd(kv: Tensor, head_size: int) -> tuple[Tensor, Tensor]:
    """[2, NB, bs, H, d] (K and V stacked first, token-major pages)."""
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


CANDIDATES: dict[str, Callable[[Tensor, int], tuple[Tensor, Tensor]]] = {
    "cpu_tiles": _cpu_tiles,
    "stacked_tiles": _stacked_tiles,
    "split_last": _split_last,
    "stacked_nhd": _stacked_nhd,
}


def probe_kv_layout(impl: object, layer: torch.nn.Module, kv_cache: Tensor, num_kv_heads: int,
                    head_size: int) -> tuple[str, KVViews]:
    """Return (name, views) for the layout ``impl`` writes, or raise ValueError naming the backend."""
    update = getattr(impl, "do_kv_cache_update", None)
    backend = getattr(layer, "attn_backend", None)  # vLLM declares this on the backend class
    if update is None or getattr(backend, "forward_includes_kv_cache_update", False):
        raise ValueError(f"KV eviction cannot probe the KV layout of {type(impl).__name__}: it writes the "
                         "cache inside forward; use a backend with a separate KV-cache update")
    block_size = None
    for name, view_fn in CANDIDATES.items():
        try:
            k, v = view_fn(kv_cache, head_size)
        except (RuntimeError, ValueError, IndexError):
            continue
        if k.dim() == 4 and k.shape[1] == num_kv_heads and k.shape[3] == head_size:
            block_size = k.shape[2]
            break
    if block_size is None:
        raise ValueError(f"KV eviction does not recognise the KV-cache shape {tuple(kv_cache.shape)} of "
                         f"{type(impl).__name__}")
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(block_size, num_kv_heads, head_size, generator=generator).to(kv_cache.device, kv_cache.dtype)
    values = torch.randn(block_size, num_kv_heads, head_size, generator=generator).to(kv_cache.device, kv_cache.dtype)
    slots = torch.arange(block_size, dtype=torch.int64, device=kv_cache.device)  # page 0: the null page
    update(layer, keys, values, kv_cache, slots)
    found: tuple[str, KVViews] | None = None
    for name, view_fn in CANDIDATES.items():
        try:
            k, v = view_fn(kv_cache, head_size)
        except (RuntimeError, ValueError, IndexError):
            continue
        if k.shape[1:] != (num_kv_heads, block_size, head_size) or v.shape != k.shape:
            continue
        if torch.equal(k[0].transpose(0, 1), keys) and torch.equal(v[0].transpose(0, 1), values):
            found = (name, lambda kv, fn=view_fn: fn(kv, head_size))
            break
    with torch.no_grad():
        k0, v0 = (found[1] if found else (lambda kv: _split_last(kv, head_size)))(kv_cache)
        k0[0].zero_()
        v0[0].zero_()
    if found is None:
        raise ValueError(f"KV eviction could not find how {type(impl).__name__} (isa "
                         f"{getattr(layer, 'isa', 'n/a')}) lays out K and V; supported layouts: "
                         f"{', '.join(CANDIDATES)}")
    return found
