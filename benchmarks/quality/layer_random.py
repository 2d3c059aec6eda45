"""kvpress's random press with a fresh draw in every layer: the yardstick for the random twin's gap.

kvpress's ``RandomPress(seed=s)`` seeds one generator with ``s`` at every call, so every layer draws the
same scores and keeps the same positions per head: a token it drops is gone from all layers at once. The
engine's random policy draws independently per layer (a hash of request seed, layer, head and position),
so every token survives in some layers. This press keeps kvpress's scoring and pruning and changes only
the seed, to ``layer_seed(seed, layer)``: scored beside kvpress's own draw and the engine's, it measures
whether that structural difference, rather than the engine, is what the scores differ by
(docs/benchmarks/quality.md, "Random").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvpress import RandomPress

LAYERS_PER_SEED = 1 << 16  # seeds of different (seed, layer) never collide below this many layers


def layer_seed(seed: int, layer: int) -> int:
    """The generator seed of one layer: distinct for every (seed, layer) with layer < LAYERS_PER_SEED."""
    return seed * LAYERS_PER_SEED + layer


@dataclass
class PerLayerRandomPress(RandomPress):
    """``RandomPress`` whose scores are drawn from a generator seeded per layer (``layer_seed``)."""

    seed: int = 0

    def score(self, module: Any, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              attentions: torch.Tensor, kwargs: Any) -> torch.Tensor:
        generator = torch.Generator(device=keys.device)
        generator.manual_seed(layer_seed(self.seed, int(module.layer_idx)))
        return torch.rand(*keys.shape[:-1], generator=generator, device=keys.device, dtype=keys.dtype)
