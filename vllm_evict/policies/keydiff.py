"""KeyDiff (Park et al., 2025): keep the keys least similar to the average key direction.

Per KV head, the anchor is the mean of the L2-normalised keys of all candidates (cache and new block
alike), and a token's score is −cos(k_i, anchor): distinctive keys survive, typical ones are evicted
(keydiff.md §3.2, §4). Only keys are read, so it needs no queries and no attention probabilities.
By default nothing is protected; ``recent`` reproduces the paper's recent-token ablation (§3.6).
The arithmetic is ``vllm_evict.dense.keydiff_scores`` (the anchor form, Eq. 8).
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent


class KeyDiff(SinksAndRecent):
    name = "keydiff"
    summary = "keeps the keys least similar (cosine) to the mean key direction; needs no attention"
    paper = ("Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
             "in Resource-Constrained Environments (2025)")
    one_shot = False
    is_attention_mass = False

    @property
    def query_window(self) -> int:
        return 0

    def scores(self, inp: EvictionInputs) -> Tensor:
        # The anchor covers every candidate, protected ones included (keydiff.md §9.6).
        return dense.protect(inp.ops.keydiff_scores(inp), self.protected_mask(inp))
