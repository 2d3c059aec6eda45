"""KeyL2Norm (Devoto et al., 2024): keep the tokens whose keys have the smallest L2 norm.

Low-norm keys tend to draw high attention, so the score is −||k_i||₂ per KV head, computed on the
cached (post-RoPE, which preserves norms) keys in fp32 (keydiff.md §8). No queries are needed.
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, Policy, protect, recent_mask, sink_mask
from vllm_evict.policies.options import check_int


class KeyNorm(Policy):
    name = "knorm"
    summary = "keeps the keys with the smallest L2 norm (KeyL2Norm); needs no attention"
    paper = "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression (2024)"
    one_shot = False
    is_attention_mass = False
    defaults = {"sinks": 0, "recent": 0}

    @property
    def query_window(self) -> int:
        return 0

    def check_options(self) -> None:
        check_int("sinks", self.sinks)
        check_int("recent", self.recent)

    def protected_count(self, budget: int) -> int:
        return self.sinks + self.recent

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return recent_mask(inp.positions, self.recent) | sink_mask(inp.positions, self.sinks)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return protect(-inp.keys.float().norm(dim=-1), self.protected_mask(inp))
