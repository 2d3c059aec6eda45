"""CAOTE and FastCAOTE (Goel et al., Qualcomm AI Research): a meta score over any attention-mass base.

The base's mass ``h`` over the n candidates of a KV head is turned into weights ``alpha = h / sum(h)``
(uniform when the mass is all zero). Treating ``alpha`` as one query's attention, dropping token j and
renormalising the rest moves the output ``X = sum_j alpha_j v_j`` by exactly

    c_j = alpha_j / (1 - alpha_j) * ||X - v_j||_2

(spec caote.md §3.3, §3.5), and CAOTE keeps the tokens whose removal would move it most. FastCAOTE
replaces ``X`` by the plain mean of the candidate values (§3.4).

Numerics (§3.8): fp32 throughout; ``1 - alpha`` is clamped at ``eps`` and a token with
``1 - alpha < eps`` scores +inf (its distance is rounding noise there); the base's protected tokens
count in ``alpha`` and ``X`` and get +inf afterwards. Several tokens are dropped by independent top-k
(§3.6, the paper's choice).

GQA (§3.7), option ``caote_mode``:
- ``"group"`` (default, (A)): the base's group-mean mass gives one ``alpha``, one ``X`` and one ``c``
  per KV head.
- ``"head"`` ((B)): every query head g of the group gets its own ``alpha_g`` (from its own mass),
  ``X_g`` and ``c_g``; the KV head's score is ``sqrt(sum_g c_g**2)``, the error of the concatenated
  head outputs. This needs the base's per-query-head mass: a base provides it by defining
  ``group_masses(inp) -> [H_kv, G, n]`` (finite, non-negative, whose group mean is its
  ``attention_mass``). SnapKV does not define it yet, so this module carries an equivalent adapter for
  it (``_snapkv_group_masses``); any other base without the method is rejected at config time.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, MetaPolicy, Policy, protect
from vllm_evict.policies.options import check_choice, check_float

CAOTE_MODES = ("group", "head")


def _snapkv_group_masses(policy: Policy, inp: EvictionInputs) -> Tensor:
    """SnapKV's ``attention_mass`` before the group mean: window column sums pooled per query head.

    With average pooling the group mean of this equals ``SnapKV.attention_mass`` (pooling is linear);
    with max pooling each query head is pooled on its own, which is what per-head scoring means.
    """
    from vllm_evict.policies.attention import pool_in_position_order

    sums = inp.kernels.column_sums(inp, inp.queries, inp.query_positions, per_query_head=True)
    return pool_in_position_order(sums, inp.positions, policy.kernel, policy.pooling)


# Base name -> per-query-head mass, for bases that do not (yet) define ``group_masses`` themselves.
_GROUP_MASS_ADAPTERS: dict[str, Callable[[Policy, EvictionInputs], Tensor]] = {
    "snapkv": _snapkv_group_masses,
}


def group_mass_fn(base: Policy | type[Policy]) -> Callable[[Policy, EvictionInputs], Tensor] | None:
    """How to get ``[H_kv, G, n]`` per-query-head masses from ``base``, or None if it cannot say."""
    method = getattr(base, "group_masses", None)
    if callable(method):
        return lambda policy, inp: policy.group_masses(inp)
    return _GROUP_MASS_ADAPTERS.get(getattr(base, "name", ""))


def head_mode_bases() -> list[str]:
    """Registered bases usable with ``caote_mode="head"`` (those whose module imports)."""
    from vllm_evict.policies import BASE_POLICIES, load_class

    names = []
    for name in BASE_POLICIES:
        try:
            cls = load_class(name)
        except (ImportError, AttributeError):  # a module not written yet must not break the message
            continue
        if cls.is_attention_mass and group_mass_fn(cls) is not None:
            names.append(name)
    return names


def normalise_mass(mass: Tensor) -> Tensor:
    """``alpha = h / sum(h)`` along the last axis; uniform where the mass sums to zero. fp32."""
    h = mass.float().clamp_min(0.0)  # rounding can leave a tiny negative; the contract says >= 0
    total = h.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(h, 1.0 / max(h.shape[-1], 1))
    return torch.where(total > 0, h / torch.where(total > 0, total, torch.ones_like(total)), uniform)


def output_error(alpha: Tensor, values: Tensor, center: Tensor, eps: float) -> Tensor:
    """``alpha/(1-alpha) * ||center - v_j||_2`` with +inf where ``1 - alpha < eps``.

    alpha [H_kv, *, n], values [H_kv, n, d], center [H_kv, *, d] (the same leading shape as alpha).
    """
    v = values.float()
    extra = alpha.dim() - 2  # 0 for group mode, 1 for head mode
    v = v.view(v.shape[0], *([1] * extra), *v.shape[1:])
    dist = torch.linalg.vector_norm(center.unsqueeze(-2) - v, dim=-1)  # direct difference (§3.8)
    one_minus = 1.0 - alpha
    c = alpha / one_minus.clamp_min(eps) * dist
    return torch.where(one_minus < eps, torch.full_like(c, float("inf")), c)


class CAOTE(MetaPolicy):
    name = "caote"
    summary = ("attention-output change if a token were dropped: alpha/(1-alpha)*||X - v||, alpha = the "
               "base's mass normalised to sum 1, X = sum alpha*v")
    paper = "Goel et al., CAOTE: KV Cache Eviction for LLMs via Attention Output Error-Based Token Selection (2025)"
    defaults = {"caote_mode": "group", "eps": 1e-6}
    fast = False  # FastCAOTE: X is the unweighted mean of the values

    def check_options(self) -> None:
        check_choice("caote_mode", self.caote_mode, CAOTE_MODES)
        check_float("eps", self.eps, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.caote_mode == "head" and group_mass_fn(self.base) is None:
            valid = ", ".join(head_mode_bases()) or "none"
            raise ValueError(
                f"caote_mode 'head' needs the base's per-query-head attention mass, which {self.base.name} "
                f"does not provide; use caote_mode 'group', or one of these bases: {valid}")

    def _head_centers(self, alpha: Tensor, values: Tensor) -> Tensor:
        """X_g per query head [H_kv, G, d] for ``alpha`` [H_kv, G, n] (head mode)."""
        v = values.float()
        if self.fast:
            return v.mean(dim=1).unsqueeze(1).expand(-1, alpha.shape[1], -1)  # one mean for the group
        return torch.einsum("hgn,hnd->hgd", alpha, v)

    def scores(self, inp: EvictionInputs) -> Tensor:
        if self.caote_mode == "head":
            mass = group_mass_fn(self.base)(self.base, inp)  # [H_kv, G, n]
            alpha = normalise_mass(mass)
            per_head = output_error(alpha, inp.values, self._head_centers(alpha, inp.values), self.eps)
            c = torch.linalg.vector_norm(per_head, dim=1)  # quadrature over the group; +inf stays +inf
        else:
            alpha = normalise_mass(self.base.attention_mass(inp))  # [H_kv, n]
            c = inp.kernels.value_error(inp, alpha, self.fast, self.eps)
        return protect(c, self.base.protected_mask(inp))


class FastCAOTE(CAOTE):
    name = "fastcaote"
    summary = "CAOTE with X replaced by the plain mean of the candidate values (cheaper, about as good)"
    fast = True
