"""Random eviction: a uniformly random choice of survivors, the floor every scored method must beat.

Scores are i.i.d. uniform, one per (request seed, layer, global KV head, logical length, token
position), from a counter-based hash (``vllm_evict.dense.uniform_hash``): reproducible, identical on
CPU and GPU and for any tensor-parallel size (heads are numbered globally), independent of the slot
order and of the other requests in the batch, different for every head and layer, and fresh at every
eviction event (reusing one draw per layer would turn a fixed ranking into a systematic bias).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent


def head_draws(inp: EvictionInputs, stream: int = 0) -> Tensor:
    """Uniform (0, 1) draws [R, H_kv, N] keyed by (seed, layer, global head, seq_len, position, stream)."""
    rows, heads = inp.num_rows, inp.num_kv_heads
    seed = dense.as_rows(inp.seed, rows, inp.device, torch.int64).view(rows, 1, 1)
    head = (inp.head_offset + torch.arange(heads, device=inp.device)).view(1, heads, 1)
    seq_len = inp.seq_len.view(rows, 1, 1)
    return dense.uniform_hash(seed, inp.layer, head, seq_len, inp.positions.long().clamp_min(0), stream)


class RandomPolicy(SinksAndRecent):
    name = "random"
    summary = "uniformly random survivors, reproducible from the request seed (a lower baseline)"
    paper = "baseline (no paper): uniform random eviction"
    one_shot = False
    is_attention_mass = False

    @property
    def query_window(self) -> int:
        return 0

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(head_draws(inp), self.protected_mask(inp))
