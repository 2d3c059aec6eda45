"""Builders of small paged caches for the kernel tests (several layouts, shuffled pages)."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict.policies.base import topk_keep

LAYOUTS = ("nhd", "hnd", "cpu")


def make_kv(num_blocks: int, heads: int, block_size: int, d: int, dtype: torch.dtype, layout: str,
            device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(K, V) views [num_blocks, H, block_size, d] laid out as a backend stores them.

    nhd: one buffer [nb, bs, H, 2d] split as FLASH_ATTN does (strided, heads interleaved);
    hnd: one buffer [nb, H, bs, 2d] (LBHNC);
    cpu: the CPU backend's tile pair per (block, head): K transposed [d, bs], then V [bs, d].
    """
    g = torch.Generator().manual_seed(seed)
    if layout == "nhd":
        raw = torch.randn(num_blocks, block_size, heads, 2 * d, generator=g)
        raw = raw.to(dtype).to(device)
        k, v = raw.transpose(1, 2).split(d, dim=-1)
    elif layout == "hnd":
        raw = torch.randn(num_blocks, heads, block_size, 2 * d, generator=g).to(dtype).to(device)
        k, v = raw.split(d, dim=-1)
    elif layout == "cpu":
        raw = torch.randn(num_blocks, heads, 2 * block_size * d, generator=g).to(dtype).to(device)
        k = raw[:, :, : block_size * d].view(num_blocks, heads, d, block_size).transpose(2, 3)
        v = raw[:, :, block_size * d:].view(num_blocks, heads, block_size, d)
    else:
        raise ValueError(layout)
    return k, v


def block_table(lengths: list[int], block_size: int, num_blocks: int, device: torch.device,
                seed: int = 0, dtype: torch.dtype = torch.int32) -> Tensor:
    """Disjoint, shuffled pages per request; unused entries of a row hold page 0."""
    g = torch.Generator().manual_seed(seed + 1)
    pages = torch.randperm(num_blocks, generator=g)
    need = [-(-n // block_size) for n in lengths]
    if sum(need) > num_blocks:
        raise ValueError("not enough blocks")
    width = max(need)
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = pages[at: at + n]
        at += n
    return table.to(dtype).to(device)


def positions_buffer(num_blocks: int, heads: int, block_size: int, table: Tensor, lengths: list[int],
                     device: torch.device, seed: int = 0) -> Tensor:
    """Per-slot logical positions after a pretend compaction: per head an increasing random subset of
    0..(2 * length), permuted within the request (slots no longer in position order)."""
    g = torch.Generator().manual_seed(seed + 2)
    pos = torch.full((num_blocks, heads, block_size), -1, dtype=torch.int64)
    for r, n in enumerate(lengths):
        for h in range(heads):
            chosen = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
            chosen = chosen[torch.randperm(n, generator=g)]
            slots = torch.arange(n)
            pos[table[r, slots // block_size].long().cpu(), h, slots % block_size] = chosen
    return pos.to(device)


def assert_same_keep(scores: Tensor, reference: Tensor, lengths: list[int], budget: int, rtol: float) -> None:
    """The kept sets (topk_keep over each request's valid slots) agree; where they differ, the swapped
    tokens are a genuine near-tie of the reference scores (within ``rtol``)."""
    for r, n in enumerate(lengths):
        b = min(budget, n)
        got = topk_keep(scores[r, :, :n], b)
        want = topk_keep(reference[r, :, :n], b)
        if torch.equal(got, want):
            continue
        ref = reference[r, :, :n].float()
        for h in range(ref.shape[0]):
            extra = set(got[h].tolist()) - set(want[h].tolist())
            missing = set(want[h].tolist()) - set(got[h].tolist())
            if not extra:
                continue
            lo = ref[h, sorted(missing)].min()
            hi = ref[h, sorted(extra)].max()
            assert (lo - hi).abs() <= rtol * max(lo.abs().item(), hi.abs().item(), 1e-12), (
                f"request {r} head {h}: kept sets differ beyond a tie ({sorted(extra)} vs {sorted(missing)})")


TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 1e-2}
