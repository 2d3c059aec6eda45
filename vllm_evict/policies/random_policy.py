"""Random eviction: a uniformly random choice of survivors, the floor every scored method must beat.

Scores are i.i.d. uniform, drawn per (layer, KV head, token) from a CPU generator seeded by the
request seed, the layer and the step (``seq_len``). The draw is therefore reproducible, identical on
CPU and GPU, different for every head and layer, and fresh at every eviction event (reusing one draw
per layer would turn a fixed slot ranking into a systematic bias, e.g. always evicting the newest slot).
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, SinksAndRecent, protect


def stream_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (Python's ``hash`` is not meant to be stable)."""
    digest = hashlib.blake2b(":".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


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
        gen = torch.Generator(device="cpu").manual_seed(stream_seed(inp.seed, inp.layer, inp.seq_len))
        # Drawn on the CPU and then moved, so that CPU and GPU runs keep the same tokens.
        draw = torch.rand(inp.positions.shape, generator=gen, dtype=torch.float32)
        return protect(draw.to(inp.device), self.protected_mask(inp))
