"""KeyL2Norm (Devoto et al., 2024): keep the tokens whose keys have the smallest L2 norm.

Low-norm keys tend to draw high attention, so the score is −||k_i||₂ per KV head, computed on the
cached (post-RoPE, which preserves norms) keys in fp32 (keydiff.md §8). No queries are needed.
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent


class KeyNorm(SinksAndRecent):
    name = "knorm"
    summary = "keeps the keys with the smallest L2 norm (KeyL2Norm); needs no attention"
    paper = "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (2024)"
    one_shot = False
    is_attention_mass = False

    @property
    def query_window(self) -> int:
        return 0

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(-inp.keys.float().norm(dim=-1), self.protected_mask(inp))
