"""SnapKV (Li et al., 2024): attention from an observation window of recent queries, pooled along
the token axis; the window's own tokens are always kept.

Defaults follow the CAOTE/KeyDiff harness (spec caote.md §3.1, keydiff.md §8): window 32 queries,
average pooling with kernel 7, the 32 most recent tokens protected, GQA group mean.

Two masses, for two readers: ``ranking_mass`` is SnapKV's own ranking (window columns dropped, each query
head pooled, then the group mean; CriticalKV's stage 1 reads it too), ``attention_mass`` is the finite
mass over every candidate, window included, that CAOTE normalises into output weights.
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import WINDOW_MASS, EvictionInputs, Policy
from vllm_evict.policies.options import check_choice, check_int, check_odd_kernel


class SnapKV(Policy):
    name = "snapkv"
    summary = "pooled attention from the last `window` queries; the window's tokens are always kept"
    paper = "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation (2024)"
    one_shot = True
    is_attention_mass = True
    state_names = (WINDOW_MASS,)
    state_variants = ({"pooling": "max"},)  # max pooling reads the window mass per query head
    window: int = 32  # observation-window queries; their tokens are always kept
    kernel: int = 7  # odd pooling kernel
    pooling: str = "avg"  # "avg", "max" or "none"
    sinks: int = 0

    @property
    def query_window(self) -> int:
        return self.window

    def check_options(self) -> None:
        check_int("window", self.window, minimum=1)
        check_odd_kernel("kernel", self.kernel)
        check_choice("pooling", self.pooling, ("avg", "max", "none"))
        check_int("sinks", self.sinks)

    def protected_count(self, budget: int) -> int:
        return self.window + self.sinks

    @property
    def needs_window_heads(self) -> bool:
        # Max pooling does not commute with the group mean; average pooling (and none) does.
        return self.pooling == "max"

    def _pool(self, scores: Tensor, inp: EvictionInputs) -> Tensor:
        return dense.pool_in_position_order(scores, inp.positions, inp.valid, self.option(inp, "kernel"),
                                            self.pooling, self.option_max(inp, "kernel"))

    def window_mass(self, inp: EvictionInputs) -> Tensor:
        """Attention of the window queries summed over the window, GQA group mean: [R, H_kv, N]."""
        return inp.window_mass() / inp.group_size

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        """The window's mass pooled over the whole token axis, window tokens included: finite for every
        candidate, as CAOTE's output weights need (caote.md §3.1)."""
        return self._pool(self.window_mass(inp), inp).masked_fill(~inp.valid, 0.0)

    def group_masses(self, inp: EvictionInputs) -> Tensor:
        """``attention_mass`` before the group mean: window column sums pooled per query head
        [R, H_kv, G, N] (CAOTE's per-head mode). With average pooling their group mean is
        ``attention_mass`` (pooling is linear)."""
        return self._pool(inp.window_mass(per_query_head=True), inp)

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """The window rows the mass sums: the queries the row has (at most ``window``)."""
        return inp.window_queries().clamp_min(1)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        valid = inp.valid
        return (dense.recent_mask(inp.positions, valid, self.option(inp, "window"))
                | dense.sink_mask(inp.positions, valid, self.option(inp, "sinks")))

    def ranking_mass(self, inp: EvictionInputs) -> Tensor:
        """SnapKV's own statistic (criticalkv.md §2.5 steps 3-5, as the reference implementations): per
        query head, the window's column sums with the window's own columns dropped (zeroing them before
        zero-padded pooling is the same thing), pooled, then the GQA group mean: [R, H_kv, N]. So the
        tokens just before the window get no share of the window's attention to itself. Pooling each
        query head before the mean matters for max pooling only: average pooling is linear, so it pools
        the group mean instead (one pass, and no per-query-head mass to keep)."""
        window = dense.recent_mask(inp.positions, inp.valid, self.option(inp, "window"))  # [R, H, N]
        if self.needs_window_heads:
            per_head = inp.window_mass(per_query_head=True).masked_fill(window.unsqueeze(2), 0.0)
            return self._pool(per_head, inp).mean(dim=2).masked_fill(~inp.valid, 0.0)
        mean = (inp.window_mass() / inp.group_size).masked_fill(window, 0.0)
        return self._pool(mean, inp).masked_fill(~inp.valid, 0.0)

    def scores(self, inp: EvictionInputs) -> Tensor:
        """As the original SnapKV: only the tokens before the window are scored and pooled, the window is
        kept outright."""
        return dense.protect(self.ranking_mass(inp), self.protected_mask(inp))
