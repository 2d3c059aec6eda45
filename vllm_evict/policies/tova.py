"""TOVA, Token Omission Via Attention (Oren et al., 2024): keep the tokens the newest query attends to.

The score is the attention row of the last query (the last prompt token, or the token being decoded).
As in the authors' release, the cache is cut to the budget once the whole prompt has been processed
(one-shot), then while decoding; ``schedule="chunked"`` evicts after every prompt chunk instead, with each
chunk's last query. Option ``heads`` says over which query heads it is averaged:

- ``"layer"`` (default): over all H_q query heads of the layer, as the TOVA paper and NVIDIA kvpress do,
  so every KV head of a layer keeps the same tokens;
- ``"group"``: over the G query heads of each KV head's GQA group (the CAOTE/KeyDiff harness reading,
  caote.md §3.1), so each KV head chooses on its own.

``attention_mass`` stays the group mean in both modes: it is the per-KV-head output weight that CAOTE
normalises (caote.md §3.1, §3.7); ``ranking_mass`` is what TOVA itself (and CriticalKV's stage 1)
ranks by.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import WINDOW_MASS, EvictionInputs, SinksAndRecent
from vllm_evict.policies.options import check_choice

HEADS = ("layer", "group")


def layer_mean(per_kv_head: Tensor, positions: Tensor, valid: Tensor, bound: int,
               query_heads: int, sum_over_layer: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Mean over all query heads of the layer, per logical position: [R, H_kv, N] group sums -> [R, H_kv, N].

    Each candidate gets the mean, over the layer's query heads, of the attention its logical position
    receives; a query head whose KV head no longer holds that position contributes 0 (as attention to an
    evicted token). Matching by position, not by slot, keeps this right whatever the slot order.
    ``bound``: a host int above every position (a padding slot counts at position ``bound``);
    ``query_heads``: the layer's query heads; ``sum_over_layer`` adds the other tensor-parallel ranks'
    per-position totals (default: none)."""
    rows, heads, n = per_kv_head.shape
    per_kv_head = per_kv_head.masked_fill(~valid, 0.0)
    index = positions.long().clamp(0, bound - 1).masked_fill(~valid, bound).view(rows, -1)
    totals = torch.zeros(rows, bound + 1, dtype=per_kv_head.dtype, device=per_kv_head.device)
    totals.scatter_add_(1, index, per_kv_head.view(rows, -1))
    if sum_over_layer is not None:
        totals = sum_over_layer(totals)
    return (totals.gather(1, index).view(rows, heads, n) / query_heads).masked_fill(~valid, 0.0)


class TOVA(SinksAndRecent):
    name = "tova"
    summary = "attention of the newest query (mean over the layer's query heads); evicts what it ignores"
    paper = "Oren et al., Transformers are Multi-State RNNs (TOVA, 2024)"
    # The release (tova_cache.py) runs the prompt in one forward and cuts the cache to its size after it
    # (one score row: the last prompt token's), then drops one token per decoding step: one-shot.
    one_shot = True
    is_attention_mass = True
    state_names = (WINDOW_MASS,)
    heads: str = "layer"  # "layer" or "group": which query heads the newest row is averaged over

    @property
    def query_window(self) -> int:
        return 1

    def check_options(self) -> None:
        super().check_options()
        check_choice("heads", self.heads, HEADS)

    def group_masses(self, inp: EvictionInputs) -> Tensor:
        """A^(g)_{last, j} for every query head g of each group: [R, H_kv, G, N] (CAOTE's per-head mode)."""
        # Whatever window the caller hands over, only the newest query counts.
        return inp.window_mass(count=1, per_query_head=True)

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        """h_j = (1/G) sum_g A^(g)_{last, j}: one softmax row per query head, so it sums to 1 per KV head."""
        return inp.window_mass(count=1) / inp.group_size

    def ranking_mass(self, inp: EvictionInputs) -> Tensor:
        if self.heads == "group":
            return self.attention_mass(inp)
        # Under tensor parallelism the other ranks' query heads count too: their totals are added.
        return layer_mean(inp.window_mass(count=1), inp.positions, inp.valid, inp.seq_len_bound,
                          query_heads=inp.layer_query_heads, sum_over_layer=inp.ops.sum_over_layer)

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        return torch.ones(inp.num_rows, dtype=torch.int64, device=inp.device)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(self.ranking_mass(inp), self.protected_mask(inp))
