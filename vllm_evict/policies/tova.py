"""TOVA, Token Omission Via Attention (Oren et al., 2024): keep the tokens the newest query attends to.

The score is the attention row of the last query (the last token of a prefill block, or the token
being decoded), averaged over the G query heads of each KV head's group as the CAOTE/KeyDiff harness
does (caote.md §3.1, §8). The original paper averages over all heads of a layer instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent


class TOVA(SinksAndRecent):
    name = "tova"
    summary = "attention of the newest query (GQA group mean); evicts what it ignores"
    paper = "Oren et al., Transformers are Multi-State RNNs (TOVA, 2024)"
    one_shot = False
    is_attention_mass = True

    @property
    def query_window(self) -> int:
        return 1

    def group_masses(self, inp: EvictionInputs) -> Tensor:
        """A^(g)_{last, j} for every query head g of each group: [R, H_kv, G, N] (CAOTE's per-head mode)."""
        # Whatever window the caller hands over, only the newest query counts.
        return inp.ops.window_mass(inp, query_positions=inp.latest_query_positions(1), per_query_head=True)

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        """h_j = (1/G) sum_g A^(g)_{last, j}: one softmax row per query head, so it sums to 1 per KV head."""
        return inp.ops.window_mass(inp, query_positions=inp.latest_query_positions(1)) / inp.group_size

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        return torch.ones(inp.num_rows, dtype=torch.int64, device=inp.device)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(self.attention_mass(inp), self.protected_mask(inp))
