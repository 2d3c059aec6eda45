"""StreamingLLM / Sink (Xiao et al., 2024): keep the first ``sinks`` tokens and a sliding window.

No scoring: the attention-sink tokens (the first ``sinks`` logical positions) are always kept, and the
rest of the budget goes to the most recent tokens (caote.md §8, keydiff.md §8: first 4 + newest b−4).
Cached keys keep their original RoPE positions; nothing is re-positioned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, Policy
from vllm_evict.policies.options import check_int


class StreamingLLM(Policy):
    name = "streamingllm"
    summary = "first `sinks` tokens plus the most recent ones (attention sinks + sliding window)"
    paper = "Xiao et al., Efficient Streaming Language Models with Attention Sinks (2024)"
    one_shot = False
    is_attention_mass = False
    sinks: int = 4  # attention-sink tokens kept at the start

    @property
    def query_window(self) -> int:
        return 0

    def check_options(self) -> None:
        check_int("sinks", self.sinks)

    def protected_count(self, budget: int) -> int:
        return self.sinks

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return dense.sink_mask(inp.positions, inp.valid, self.option(inp, "sinks"))

    def scores(self, inp: EvictionInputs) -> Tensor:
        """Recency rank in logical order (0 = oldest), so top-k takes the newest tokens.

        The rank rather than the raw position: positions beyond 2^24 would collide in fp32, ranks stay
        exact for any realistic cache size, and the slot order (which compaction may shuffle) is irrelevant.
        """
        order = dense.order_by_position(inp.positions, inp.valid)
        ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous()
        rank = torch.empty_like(order).scatter_(-1, order, ranks)
        return dense.protect(rank.float(), self.protected_mask(inp))
