"""NaCl (Chen et al., ACL 2024): proxy-token top-k plus attention-weighted random sampling, once at
the end of the prompt.

Spec: nacl.md. Per KV head h, with the spec's recommended resolutions ([R]):

* proxy score (§3): F_h = GQA-group MEAN of the causal softmax column sums over the proxy queries,
  the last n_p queries;
* protected (§4): the first ``sinks`` positions and the last n_p tokens (the tail contains every
  proxy); all counted inside the budget B;
* the rest of the budget, R = B - |protected|, splits into B_prox = round((1 - random_ratio) * R)
  tokens taken by top-k of F, and B_rand = R - B_prox tokens sampled WITHOUT replacement with
  probability proportional to softmax(F / temperature) over the candidates left (Gumbel-top-k).

Proxy count: NaCl's proxy tokens are the question (paper §3, §5.1). An engine cannot see where a
prompt's question starts, so a request that knows says it: ``proxy`` = the question's token count (per
request: ``kv_eviction_config: {"proxy": N}``). Without it (``proxy=None``) the proxies are the last
``DEFAULT_PROXY`` = 32 tokens, the tail where a chat prompt's question sits (the size of SnapKV's
observation window), bounded by ⌊(B - sinks) / 2⌋ (half the non-sink budget stays for selection) and by
the queries available. The spec's earlier rule, 10% of the prompt, spent up to half the budget on a
protected tail that is mostly document, not question (docs/benchmarks/quality.md measures both).

The random stream: Gumbel noise comes from a counter-based hash of (request seed, layer, global KV
head, logical length, token position) (``vllm_evict.dense.uniform_hash``), so the same request
evicted the same way always keeps the same tokens, whatever the batch, the device or the tensor-
parallel size; heads and layers draw independently, and a later eviction of the same request draws
afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import WINDOW_MASS, EvictionInputs, Policy, per_row
from vllm_evict.policies.options import check_float, check_int
from vllm_evict.policies.random_policy import head_draws

GUMBEL_STREAM = 1  # keeps NaCl's draws apart from the random policy's


def gumbel_noise(inp: EvictionInputs) -> Tensor:
    """Gumbel(0, 1) noise [R, H_kv, N], one reproducible draw per (seed, layer, global head, length, position)."""
    return -torch.log(-torch.log(head_draws(inp, GUMBEL_STREAM)))


def first_k_mask(keys: Tensor, eligible: Tensor, counts: Tensor) -> Tensor:
    """Bool [R, H, N]: per (row, head), the ``counts`` eligible entries with the largest keys (ties: lower slot)."""
    ranked = keys.float().masked_fill(~eligible, float("-inf"))
    return eligible & (dense.rank_descending(ranked) < counts.unsqueeze(-1))


@dataclass
class NaClSelection:
    """The three disjoint parts of NaCl's kept set, bool [R, H_kv, N] each."""

    protected: Tensor
    proxy_top: Tensor
    random: Tensor

    @property
    def keep_mask(self) -> Tensor:
        return self.protected | self.proxy_top | self.random


class NaCl(Policy):
    name = "nacl"
    summary = "top-k of attention from proxy queries (the question, or the last 32 tokens) plus tokens sampled from its softmax"
    paper = "Chen et al., NaCl: A General and Effective KV Cache Eviction Framework for LLMs at Inference Time (ACL 2024)"
    one_shot = True
    is_attention_mass = True
    state_names = (WINDOW_MASS,)
    proxy: int | None = None  # n_p proxy queries (the question's tokens); None: DEFAULT_PROXY, capped
    sinks: int = 4
    random_ratio: float = 7 / 19  # the share of the free budget drawn at random
    temperature: float = 1.0  # of the softmax the random part samples from

    # Proxies when the request does not say (the tail of the prompt, where the question is).
    DEFAULT_PROXY = 32

    @property
    def query_window(self) -> int:
        return self.DEFAULT_PROXY if self.proxy is None else self.proxy

    def window_for(self, budget: int | None) -> int:
        # The default never exceeds floor((B - sinks) / 2): a ring that wide is all a request needs.
        if self.proxy is not None or budget is None:
            return self.query_window
        return min(self.DEFAULT_PROXY, max(1, self._rule_cap(budget)))

    def cap_query_window(self, limit: int) -> None:
        # The default n_p is also bounded by the widest window the engine reserves (its max_window).
        if self.proxy is None:
            self.DEFAULT_PROXY = max(1, min(type(self).DEFAULT_PROXY, limit))

    def check_options(self) -> None:
        if self.proxy is not None:
            check_int("proxy", self.proxy, minimum=1)
        check_int("sinks", self.sinks)
        check_float("random_ratio", self.random_ratio, low=0.0, high=1.0)
        check_float("temperature", self.temperature, low=1e-4, high=1e4)

    def _rule_cap(self, budget: int) -> int:
        """floor((B - sinks) / 2): the cap that leaves half the non-sink budget to selection."""
        return max(0, (budget - self.sinks) // 2)

    def protected_count(self, budget: int) -> int:
        if self.proxy is not None:
            return self.sinks + self.proxy
        return self.sinks + min(self.DEFAULT_PROXY, self._rule_cap(budget))

    def validate(self, budget: int) -> None:
        if self.proxy is None and self._rule_cap(budget) < 1:
            raise ValueError(
                f"budget {budget} leaves no proxy query for nacl: the proxy window is capped at "
                f"(budget - sinks) // 2 = {self._rule_cap(budget)}; raise the budget or lower sinks ({self.sinks})")

    # ---- scoring ---------------------------------------------------------------------------
    def proxy_rule(self, seq_len: Tensor | np.ndarray, budget: Tensor | np.ndarray | None) -> Tensor | np.ndarray:
        """n_p per row before the queries available are counted: ``proxy``, or ``DEFAULT_PROXY`` capped at
        floor((B - sinks) / 2) (int64, torch or numpy alike; ``budget`` None: the cap is not applied)."""
        return self._proxy_rule(seq_len, budget, self.proxy, self.sinks)

    def _proxy_rule(self, seq_len: Any, budget: Any, proxy: Any, sinks: Any) -> Any:
        if proxy is not None:
            return seq_len * 0 + proxy
        n_p = seq_len * 0 + self.DEFAULT_PROXY
        if budget is None:
            return n_p
        if isinstance(n_p, np.ndarray):
            return np.minimum(n_p, np.maximum((budget - sinks) // 2, 0))
        return torch.minimum(n_p, ((budget - sinks) // 2).clamp_min(0))

    def window_size(self, seq_len: np.ndarray, budget: np.ndarray) -> np.ndarray:
        return np.asarray(self.proxy_rule(seq_len.astype(np.int64), budget.astype(np.int64)), dtype=np.int64)

    def proxy_count(self, inp: EvictionInputs) -> Tensor:
        """n_p per row [R] (see the module docstring); with no budget the cap is not applied."""
        proxy = self.option(inp, "proxy") if self.proxy is not None else None
        n_p = self._proxy_rule(inp.seq_len.long(), inp.budget, proxy, self.option(inp, "sinks"))
        return torch.minimum(n_p, inp.window_queries())

    def proxy_score(self, inp: EvictionInputs, n_proxy: Tensor) -> Tensor:
        """F [R, H_kv, N]: causal softmax column sums over the last ``n_proxy`` queries, GQA group mean."""
        return inp.window_mass(count=n_proxy) / inp.group_size

    def _protected(self, inp: EvictionInputs, n_proxy: Tensor) -> Tensor:
        valid = inp.valid
        return (dense.sink_mask(inp.positions, valid, self.option(inp, "sinks"))
                | dense.recent_mask(inp.positions, valid, n_proxy))

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return self._protected(inp, self.proxy_count(inp))

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        return self.proxy_score(inp, self.proxy_count(inp))

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """Group mean of the column sums over its n_p proxy queries."""
        return self.proxy_count(inp)

    def scores(self, inp: EvictionInputs) -> Tensor:
        """The deterministic ranking (protected, then F); ``select`` adds the random part."""
        n_p = self.proxy_count(inp)
        return dense.protect(self.proxy_score(inp, n_p), self._protected(inp, n_p))

    # ---- selection -------------------------------------------------------------------------
    def split_counts(self, rest: Tensor, ratio: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
        """(B_prox, B_rand) for R = ``rest`` tokens [R, H]: B_prox = round((1 - ratio) R), halves rounded up
        (``ratio``: per row, or None: the policy's own)."""
        ratio = float(self.random_ratio) if ratio is None else ratio
        prox = torch.floor((1.0 - per_row(ratio, 2)) * rest.double() + 0.5).long()
        prox = torch.minimum(prox, rest)
        return prox, rest - prox

    def partition(self, inp: EvictionInputs) -> NaClSelection:
        n_p = self.proxy_count(inp)
        score = self.proxy_score(inp, n_p)
        protected = self._protected(inp, n_p)
        rest = (inp.budget.view(-1, 1) - protected.sum(dim=-1)).clamp(min=0)  # [R, H]
        n_top, n_rand = self.split_counts(rest, self.option(inp, "random_ratio"))
        candidates = inp.valid & ~protected
        top = first_k_mask(score, candidates, n_top)
        # Gumbel-top-k: the n_rand largest F/tau + G are a draw without replacement from softmax(F/tau).
        perturbed = score / per_row(self.option(inp, "temperature"), 3, torch.float32) + gumbel_noise(inp)
        rand = first_k_mask(perturbed, candidates & ~top, n_rand)
        return NaClSelection(protected=protected, proxy_top=top, random=rand)

    def select(self, inp: EvictionInputs) -> Tensor:
        return dense.topk_keep(self.partition(inp).keep_mask.float(), inp.valid, inp.budget, inp.budget_max)
