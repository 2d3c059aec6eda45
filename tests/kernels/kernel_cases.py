"""Builders of small paged caches for the kernel tests: backend layouts, shuffled pages, padded rows."""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_evict import dense

LAYOUTS = ("nhd", "hnd", "cpu")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
NULL_PAGE = 0  # vLLM's null page: never in a row, the references' trash page


def make_kv(num_pages: int, heads: int, page_size: int, d: int, dtype: torch.dtype, layout: str,
            device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(K, V) views [num_pages, H, page_size, d] laid out as a backend stores them.

    nhd: one buffer [pages, bs, H, 2d] split in K and V halves (heads interleaved: strided views);
    hnd: one buffer [pages, H, bs, 2d];
    cpu: vLLM's CPU backend tile pair per (page, head): K transposed [d, bs], then V [bs, d].
    """
    g = torch.Generator().manual_seed(seed)
    if layout == "nhd":
        raw = torch.randn(num_pages, page_size, heads, 2 * d, generator=g).to(dtype).to(device)
        k, v = raw.transpose(1, 2).split(d, dim=-1)
    elif layout == "hnd":
        raw = torch.randn(num_pages, heads, page_size, 2 * d, generator=g).to(dtype).to(device)
        k, v = raw.split(d, dim=-1)
    elif layout == "cpu":
        raw = torch.randn(num_pages, heads, 2 * page_size * d, generator=g).to(dtype).to(device)
        k = raw[:, :, : page_size * d].view(num_pages, heads, d, page_size).transpose(2, 3)
        v = raw[:, :, page_size * d:].view(num_pages, heads, page_size, d)
    else:
        raise ValueError(layout)
    return k, v


def pages_needed(lengths: list[int], page_size: int) -> int:
    return sum(-(-n // page_size) for n in lengths) + 1  # + the null page


def block_table(lengths: list[int], page_size: int, num_pages: int, device: torch.device, seed: int = 0,
                dtype: torch.dtype = torch.int32, spare_columns: int = 1) -> Tensor:
    """[R, pages]: disjoint shuffled pages per row, never the null page; unused entries hold the null
    page (as vLLM's block tables do), ``spare_columns`` more than the longest row needs."""
    g = torch.Generator().manual_seed(seed + 1)
    pages = torch.randperm(num_pages - 1, generator=g) + 1
    need = [-(-n // page_size) for n in lengths]
    if sum(need) > num_pages - 1:
        raise ValueError("not enough pages")
    table = torch.full((len(lengths), max(need, default=0) + spare_columns), NULL_PAGE, dtype=torch.int64)
    at = 0
    for r, n in enumerate(need):
        table[r, :n] = pages[at: at + n]
        at += n
    return table.to(dtype).to(device)


def positions_buffer(num_pages: int, heads: int, page_size: int, table: Tensor, lengths: list[int],
                     device: torch.device, seed: int = 0) -> Tensor:
    """int32 [num_pages, H, bs]: every slot's logical position after pretend evictions and a shuffle:
    per (row, head) an increasing random subset of 0..2n-1, permuted over the row's n slots (slots are
    no longer in position order, heads differ). Returns the buffer; the largest position is < 2n."""
    g = torch.Generator().manual_seed(seed + 2)
    pos = torch.full((num_pages, heads, page_size), -7, dtype=torch.int32)
    cpu_table = table.long().cpu()
    for r, n in enumerate(lengths):
        slots = torch.arange(n)
        for h in range(heads):
            chosen = torch.sort(torch.randperm(2 * n, generator=g)[:n]).values
            pos[cpu_table[r, slots // page_size], h, slots % page_size] = chosen[torch.randperm(n, generator=g)].int()
    return pos.to(device)


def valid(lengths: Tensor, width: int) -> Tensor:
    return dense.valid_slots(lengths, width)


def assert_same_keep(scores: Tensor, reference: Tensor, lengths: Tensor, budget: int, rtol: float) -> None:
    """The kept sets (``dense.topk_keep`` over each row's valid slots) agree; where they differ, the
    swapped slots are a genuine near-tie of the reference scores (within ``rtol``)."""
    rows, width = scores.shape[0], scores.shape[-1]
    flat = scores.reshape(rows, -1, width)
    flat_ref = reference.reshape(rows, -1, width)
    ok = valid(lengths, width)
    budgets = lengths.clamp_max(budget)
    got = dense.topk_keep(flat, ok, budgets, budget)
    want = dense.topk_keep(flat_ref, ok, budgets, budget)
    if torch.equal(got, want):
        return
    for r in range(rows):
        for h in range(flat.shape[1]):
            extra = set(got[r, h].tolist()) - set(want[r, h].tolist())
            missing = set(want[r, h].tolist()) - set(got[r, h].tolist())
            if not extra:
                continue
            ref = flat_ref[r, h].float()
            lo = ref[sorted(missing)].min()
            hi = ref[sorted(extra)].max()
            assert (lo - hi).abs() <= rtol * max(lo.abs().item(), hi.abs().item(), 1e-12), (
                f"row {r} head {h}: kept sets differ beyond a tie ({sorted(extra)} vs {sorted(missing)})")


class OpLog(TorchDispatchMode):
    """Every aten op dispatched inside the ``with`` block, counted by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


# Ops a launcher must never dispatch: a host-device sync (.item(), int(t)), a tensor built from Python
# data (torch.tensor), a dtype/device conversion or copy of an argument.
FORBIDDEN_OPS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten._to_copy", "aten.clone",
                 "aten.contiguous", "aten.item")
