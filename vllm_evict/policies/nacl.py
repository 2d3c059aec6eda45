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

Proxy count: the option ``proxy`` fixes n_p; ``None`` (default) uses the spec's rule
n_p = min(max(32, ceil(p / 10)), floor((B - sinks) / 2)) with p the logical length, further bounded
by the query buffer (``MAX_PROXY``) and by the queries available.

The random stream: Gumbel noise is drawn on the CPU from a ``torch.Generator`` seeded by a hash of
(request seed, layer, KV head, logical length), so the same request evicted the same way always
keeps the same tokens, heads and layers draw independently, and a later eviction of the same
request draws afresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, Policy, protect, recent_mask, sink_mask, topk_keep
from vllm_evict.policies.options import check_float, check_int

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a bijective 64-bit mixer, so nearby keys give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(*keys: int) -> int:
    """A 64-bit generator seed derived from a tuple of non-negative integers."""
    h = 0
    for key in keys:
        h = _mix64(h ^ (int(key) & _MASK64))
    return h


def gumbel_noise(n: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """n i.i.d. Gumbel(0, 1) draws (fp32) from a CPU generator seeded with ``seed``, moved to ``device``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    # u < 1 always, so -log(u) > 0 and the outer log is finite.
    return (-torch.log(-torch.log(u))).to(device=device, dtype=torch.float32)


def _first_k_mask(keys: Tensor, eligible: Tensor, counts: Tensor) -> Tensor:
    """Bool [H, n]: per row, the ``counts[h]`` eligible entries with the largest keys (ties: lower slot)."""
    ranked = keys.float().masked_fill(~eligible, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return eligible & (rank < counts.unsqueeze(-1))


@dataclass
class NaClSelection:
    """The three disjoint parts of NaCl's kept set, bool [H_kv, n] each."""

    protected: Tensor
    proxy_top: Tensor
    random: Tensor

    @property
    def keep_mask(self) -> Tensor:
        return self.protected | self.proxy_top | self.random


class NaCl(Policy):
    name = "nacl"
    summary = "top-k of attention from proxy queries (the prompt tail) plus tokens sampled from its softmax"
    paper = "Chen et al., NaCl: A General and Effective KV Cache Eviction Framework for LLMs at Inference Time (ACL 2024)"
    one_shot = True
    is_attention_mass = True
    defaults = {"proxy": None, "sinks": 4, "random_ratio": 7 / 19, "temperature": 1.0}

    # Queries the engine buffers when ``proxy`` is None (the rule's n_p is sliced from them).
    MAX_PROXY = 1024

    @property
    def query_window(self) -> int:
        return self.MAX_PROXY if self.proxy is None else self.proxy

    def check_options(self) -> None:
        if self.proxy is not None:
            check_int("proxy", self.proxy, minimum=1)
        check_int("sinks", self.sinks)
        check_float("random_ratio", self.random_ratio, low=0.0, high=1.0)
        check_float("temperature", self.temperature, low=0.0, low_open=True)

    def _rule_cap(self, budget: int) -> int:
        """floor((B - sinks) / 2): the spec's cap that leaves half the non-sink budget to selection."""
        return max(0, (budget - self.sinks) // 2)

    def protected_count(self, budget: int) -> int:
        if self.proxy is not None:
            return self.sinks + self.proxy
        return self.sinks + min(self.MAX_PROXY, self._rule_cap(budget))

    def validate(self, budget: int) -> None:
        if self.proxy is None and self._rule_cap(budget) < 1:
            raise ValueError(
                f"budget {budget} leaves no proxy query for nacl: the proxy window is capped at "
                f"(budget - sinks) // 2 = {self._rule_cap(budget)}; raise the budget or lower sinks ({self.sinks})")

    # ---- scoring ---------------------------------------------------------------------------
    def proxy_count(self, inp: EvictionInputs, budget: int | None = None) -> int:
        """n_p for this step (see the module docstring); with no budget at all the cap is not applied."""
        if budget is None:
            budget = inp.budget
        if self.proxy is not None:
            n_p = self.proxy
        else:
            n_p = min(max(32, math.ceil(inp.seq_len / 10)), self.MAX_PROXY)
            if budget is not None:
                n_p = min(n_p, self._rule_cap(budget))
        return max(0, min(n_p, inp.queries.shape[1]))

    def proxy_score(self, inp: EvictionInputs, n_proxy: int) -> Tensor:
        """F [H_kv, n]: causal softmax column sums over the last ``n_proxy`` queries, GQA group mean."""
        if n_proxy <= 0:
            return torch.zeros(inp.positions.shape, dtype=torch.float32, device=inp.device)
        w = inp.queries.shape[1]
        q = inp.queries[:, w - n_proxy:]
        qpos = inp.query_positions[w - n_proxy:]
        return inp.kernels.column_sums(inp, q, qpos) / inp.group_size

    def _protected(self, inp: EvictionInputs, n_proxy: int) -> Tensor:
        return sink_mask(inp.positions, self.sinks) | recent_mask(inp.positions, n_proxy)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return self._protected(inp, self.proxy_count(inp))

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        return self.proxy_score(inp, self.proxy_count(inp))

    def scores(self, inp: EvictionInputs) -> Tensor:
        """The deterministic ranking (protected, then F); ``select`` adds the random part."""
        n_p = self.proxy_count(inp)
        return protect(self.proxy_score(inp, n_p), self._protected(inp, n_p))

    # ---- selection -------------------------------------------------------------------------
    def split_counts(self, rest: Tensor) -> tuple[Tensor, Tensor]:
        """(B_prox, B_rand) for R = ``rest`` tokens: B_prox = round((1 - ratio) R), halves rounded up."""
        prox = torch.floor((1.0 - float(self.random_ratio)) * rest.double() + 0.5).long()
        prox = torch.minimum(prox, rest)
        return prox, rest - prox

    def noise(self, inp: EvictionInputs) -> Tensor:
        """Gumbel noise [H_kv, n], one reproducible stream per (seed, layer, KV head, logical length)."""
        h_kv, n = inp.positions.shape
        rows = [gumbel_noise(n, stream_seed(inp.seed, inp.layer, h, inp.seq_len)) for h in range(h_kv)]
        return torch.stack(rows).to(inp.device)

    def partition(self, inp: EvictionInputs, budget: int) -> NaClSelection:
        n_p = self.proxy_count(inp, budget)
        score = self.proxy_score(inp, n_p)
        protected = self._protected(inp, n_p)
        rest = (budget - protected.sum(dim=-1)).clamp(min=0)
        n_top, n_rand = self.split_counts(rest)
        candidates = ~protected
        top = _first_k_mask(score, candidates, n_top)
        # Gumbel-top-k: the n_rand largest F/tau + G are a draw without replacement from softmax(F/tau).
        perturbed = score / float(self.temperature) + self.noise(inp)
        rand = _first_k_mask(perturbed, candidates & ~top, n_rand)
        return NaClSelection(protected=protected, proxy_top=top, random=rand)

    def select(self, inp: EvictionInputs, budget: int) -> Tensor:
        return topk_keep(self.partition(inp, budget).keep_mask.float(), budget)
