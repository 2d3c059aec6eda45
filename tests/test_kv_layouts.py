"""The KV layout views read back storages built by hand in each documented layout (no vLLM needed).

Each builder below writes one (page, head) region element by element, following the description in
``vllm_evict/engine/layout.py`` (itself read from vLLM's CPU attention kernels); the views must read
every token back, and writes through the views must land where the builder put them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_evict import paged
from vllm_evict.engine.layout import CANDIDATES, PackedPages


def element_offsets(layout: str, bs: int, d: int, item: int) -> dict[tuple[str, int, int], int]:
    """{(K or V, token, dim): offset inside one head's 2 * bs * d region}, by plain loops."""
    out = {}
    for t, j in itertools.product(range(bs), range(d)):
        if layout == "cpu_tiles":
            k, v = j * bs + t, t * d + j
        elif layout == "stacked_tiles":
            k, v = t * d + j, t * d + j
        elif layout == "amx_packed":
            p = 4 // item  # elements per 4-byte pair
            group, inside = divmod(t, 16)  # K: 16 tokens per group, each a run of p dims
            k = group * 16 * d + (j // p) * 16 * p + inside * p + j % p
            pair, lane = divmod(t, p)  # V: 16 dims per group, each a run of p tokens
            v = (j // 16) * bs * 16 + pair * 16 * p + (j % 16) * p + lane
        elif layout == "neon_bfmmla":
            k = (t // 8) * (d // 4) * 32 + (j // 4) * 32 + ((t % 8) // 2) * 8 + (4 if t % 2 else 0) + j % 4
            v = (j // 2) * (bs // 4) * 8 + (t // 4) * 8 + (j % 2) * 4 + t % 4
        else:
            raise AssertionError(layout)
        out[("K", t, j)] = k
        out[("V", t, j)] = bs * d + v
    return out


def hand_built(layout: str, keys: torch.Tensor, values: torch.Tensor, num_blocks: int, page: int) -> torch.Tensor:
    """A [num_blocks, H, bs, 2d] cache whose page ``page`` holds keys/values [H, bs, d] in ``layout``."""
    heads, bs, d = keys.shape
    cache = torch.zeros(num_blocks, heads, bs, 2 * d, dtype=keys.dtype)
    region = cache[page].view(heads, 2 * bs * d)
    for (kind, t, j), offset in element_offsets(layout, bs, d, keys.element_size()).items():
        region[:, offset] = (keys if kind == "K" else values)[:, t, j]
    return cache


CASES = [(layout, dtype, bs, d)
         for layout in ("cpu_tiles", "stacked_tiles", "amx_packed", "neon_bfmmla")
         for dtype in (torch.float32, torch.bfloat16, torch.float16)
         for bs, d in ((32, 32), (32, 64), (64, 128), (32, 80))
         if not (layout == "neon_bfmmla" and dtype != torch.bfloat16)
         and not (layout == "amx_packed" and d % 16)]


@pytest.mark.parametrize("layout,dtype,bs,d", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-bs{c[2]}-d{c[3]}" for c in CASES])
def test_views_read_back_a_hand_built_page(layout, dtype, bs, d):
    heads, num_blocks, page = 2, 3, 1
    generator = torch.Generator().manual_seed(hash((layout, bs, d)) % 1000)
    keys = torch.randn(heads, bs, d, generator=generator).to(dtype)
    values = torch.randn(heads, bs, d, generator=generator).to(dtype)
    cache = hand_built(layout, keys, values, num_blocks, page)
    k_view, v_view = CANDIDATES[layout](cache, d)
    assert tuple(k_view.shape) == tuple(v_view.shape) == (num_blocks, heads, bs, d)
    assert isinstance(k_view, PackedPages) == (layout in ("amx_packed", "neon_bfmmla"))
    assert torch.equal(k_view[page], keys) and torch.equal(v_view[page], values)
    block_table = torch.tensor([[page]])
    assert torch.equal(paged.gather_tokens(k_view, block_table, bs)[0], keys)
    assert torch.equal(paged.gather_tokens(v_view, block_table, bs)[0], values)
    # Writing through the views puts each token where the hand-built layout has it.
    other = torch.zeros_like(cache)
    k_other, v_other = CANDIDATES[layout](other, d)
    paged.scatter_tokens(k_other, block_table, keys.unsqueeze(0))
    paged.scatter_tokens(v_other, block_table, values.unsqueeze(0))
    assert torch.equal(other, cache)


def test_packed_view_compacts_like_a_dense_copy():
    """compact_tokens through PackedPages moves exactly what it moves in a plain [H, n, d] copy."""
    heads, bs, d, n = 2, 32, 64, 70
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(5, heads, bs, 2 * d, generator=generator).to(torch.bfloat16)
    k_view, v_view = CANDIDATES["amx_packed"](cache, d)
    block_table = torch.tensor([[4, 1, 3]])
    dense_k = paged.gather_tokens(k_view, block_table, n)[0].clone()
    dense_v = paged.gather_tokens(v_view, block_table, n)[0].clone()
    keep = torch.stack([torch.randperm(n, generator=generator)[:20].sort().values for _ in range(heads)])
    paged.compact_tokens([k_view, v_view], block_table, keep.unsqueeze(0), torch.tensor([20]))
    index = keep.unsqueeze(-1).expand(heads, 20, d)
    assert torch.equal(paged.gather_tokens(k_view, block_table, 20)[0], dense_k.gather(1, index))
    assert torch.equal(paged.gather_tokens(v_view, block_table, 20)[0], dense_v.gather(1, index))


def test_packed_view_rejects_indexing_it_does_not_support():
    k_view, _ = CANDIDATES["amx_packed"](torch.zeros(2, 1, 32, 64, dtype=torch.bfloat16), 32)
    with pytest.raises(TypeError, match=r"PackedPages supports cache\[page\], cache\[pages\], "
                                        r"cache\[pages, :, slots\] and cache\[pages, heads, slots\]"):
        k_view[torch.zeros(2, dtype=torch.int64), 0]


# ---- every policy through the paged kernels, on a packed cache ------------------------------------------
POLICIES = [("snapkv", {}), ("h2o", {}), ("tova", {}), ("nacl", {}), ("ahakv", {}), ("keydiff", {}),
            ("random", {}), ("streamingllm", {}), ("knorm", {}), ("caote+snapkv", {}),
            ("caote+snapkv", {"caote_mode": "head"}), ("fastcaote+h2o", {}), ("criticalkv+snapkv", {})]


@pytest.mark.parametrize("spec,options", POLICIES, ids=[s + ("-head" if o else "") for s, o in POLICIES])
def test_policies_keep_the_same_tokens_from_a_packed_cache(spec, options):
    """The engine's eviction step (``evict_step``: paged score ops, deferred K/V, compaction) keeps the same
    tokens and state from the AMX layout (PackedPages) as from the strided CPU layout holding the same tokens."""
    import numpy as np

    from vllm_evict.config import EvictionConfig
    from vllm_evict.evict_step import LayerCache, Record, StepPlan, build_group, evict_layer
    from vllm_evict.policies.base import Phase

    heads, group, bs, d, n, budget, w = 2, 3, 32, 64, 75, 40, 24
    generator = torch.Generator().manual_seed(7)
    tiles = torch.randn(5, heads, bs, 2 * d, generator=generator).to(torch.bfloat16)
    block_table = torch.tensor([[3, 2, 4]])
    queries = torch.randn(1, w, heads * group, d, generator=generator).to(torch.bfloat16)
    o_proj = (torch.randn(96, heads * group * d, generator=generator) * 0.05).to(torch.bfloat16)

    def run(layout: str):
        policy = EvictionConfig.from_spec(spec, budget=budget, **options).build_policy()
        storage = tiles.clone()
        k_view, v_view = CANDIDATES[layout](storage, d)
        if layout != "cpu_tiles":
            k_tiles, v_tiles = CANDIDATES["cpu_tiles"](tiles, d)
            paged.scatter_tokens(k_view, block_table, paged.gather_tokens(k_tiles, block_table, n))
            paged.scatter_tokens(v_view, block_table, paged.gather_tokens(v_tiles, block_table, n))
        positions = torch.zeros(5, heads, bs, dtype=torch.int32)
        paged.scatter_tokens(positions, block_table, (n + torch.arange(n)).expand(1, heads, n))
        keys, values = paged.gather_tokens(k_view, block_table, n)[0], paged.gather_tokens(v_view, block_table, n)[0]
        state = {name: torch.zeros(5, heads, bs) for name in policy.state_names}
        state |= {name: torch.zeros(5, heads, bs, group) for name in policy.head_state_names}
        for name, value in policy.init_state(keys, values, o_proj).items():
            paged.scatter_tokens(state[name], block_table, value.unsqueeze(0))
        ring_positions = torch.cat([2 * n - w + torch.arange(w), torch.full((w,), -1)]).view(2, w)
        ring = torch.cat([queries, torch.zeros_like(queries)])
        cache = LayerCache(index=1, k=k_view, v=v_view, positions=positions, state=state, ring=ring,
                           scale=d ** -0.5, o_proj=o_proj if policy.needs_o_proj else None)
        one = lambda value: np.array([value], dtype=np.int64)  # noqa: E731
        step_group = build_group(policy, Phase.PROMPT_END, block_table, bs, lengths=one(n), computed=one(2 * n - w),
                                 scheduled=one(w), seed=one(5), keep=one(budget), ring_rows=one(0),
                                 token_starts=one(0))
        record = Record(pages=torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(0, dtype=torch.int64),
                        positions=torch.zeros(0, dtype=torch.int32), ring_index=None)
        plan = StepPlan(record=record, groups=[step_group], ring_positions=ring_positions)
        (keep,) = evict_layer(cache, plan, queries[0])
        kept = {"k": paged.gather_tokens(k_view, block_table, budget), "v": paged.gather_tokens(v_view, block_table, budget),
                "positions": paged.gather_tokens(positions, block_table, budget),
                **{name: paged.gather_tokens(buf, block_table, budget) for name, buf in state.items()}}
        return keep, kept

    (want_keep, want), (got_keep, got) = run("cpu_tiles"), run("amx_packed")
    assert torch.equal(got_keep, want_keep)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
