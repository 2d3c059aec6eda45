"""CAOTE and FastCAOTE (Goel et al., Qualcomm AI Research): a meta score over any attention-mass base.

The base's mass ``h`` over the candidates of a KV head is turned into weights ``alpha = h / sum(h)``
(uniform when the mass is all zero). Treating ``alpha`` as one query's attention, dropping token j and
renormalising the rest moves the output ``X = sum_j alpha_j v_j`` by exactly

    c_j = alpha_j / (1 - alpha_j) * ||X - v_j||_2

(spec caote.md §3.3, §3.5), and CAOTE keeps the tokens whose removal would move it most. FastCAOTE
replaces ``X`` by the plain mean of the candidate values (§3.4). The arithmetic is
``vllm_evict.dense.output_error``.

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
  ``group_masses(inp) -> [R, H_kv, G, N]`` (finite, non-negative, whose group mean is its
  ``attention_mass``); a base without it is rejected at config time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, MetaPolicy, Policy, per_row
from vllm_evict.policies.options import check_choice, check_float

CAOTE_MODES = ("group", "head")


def has_group_masses(base: Policy | type[Policy]) -> bool:
    return callable(getattr(base, "group_masses", None))


def head_mode_bases() -> list[str]:
    """Registered bases usable with ``caote_mode="head"`` (those whose module imports)."""
    from vllm_evict.policies import BASE_POLICIES, load_class

    names = []
    for name in BASE_POLICIES:
        try:
            cls = load_class(name)
        except (ImportError, AttributeError):  # a module not written yet must not break the message
            continue
        if cls.is_attention_mass and has_group_masses(cls):
            names.append(name)
    return names


class CAOTE(MetaPolicy):
    name = "caote"
    summary = ("attention-output change if a token were dropped: alpha/(1-alpha)*||X - v||, alpha = the "
               "base's mass normalised to sum 1, X = sum alpha*v")
    paper = "Goel et al., CAOTE: KV Cache Eviction for LLMs via Attention Output Error-Based Token Selection (2025)"
    state_variants = ({"caote_mode": "head"},)  # per query head: the window mass per query head
    caote_mode: str = "group"  # "group" or "head" (see the module docstring)
    eps: float = 1e-6  # floor on 1 - alpha
    fast = False  # FastCAOTE: X is the unweighted mean of the values

    def check_options(self) -> None:
        check_choice("caote_mode", self.caote_mode, CAOTE_MODES)
        check_float("eps", self.eps, low=0.0, high=1.0, low_open=True, high_open=True)
        if self.caote_mode == "head" and not has_group_masses(self.base):
            valid = ", ".join(head_mode_bases()) or "none"
            raise ValueError(
                f"caote_mode 'head' needs the base's per-query-head attention mass, which {self.base.name} "
                f"does not provide; use caote_mode 'group', or one of these bases: {valid}")

    @property
    def needs_window_heads(self) -> bool:
        return self.caote_mode == "head" or self.base.needs_window_heads

    def _head_scores(self, inp: EvictionInputs) -> Tensor:
        """Per query head errors combined in quadrature over the group: [R, H_kv, N]."""
        valid = inp.valid.unsqueeze(2)  # [R, 1, 1, N]
        alpha = dense.normalise_mass(self.base.group_masses(inp), valid)  # [R, H_kv, G, N]
        values = inp.values.float().masked_fill(~inp.valid.unsqueeze(-1), 0.0)
        if self.fast:  # one mean for the whole group
            center = (values.sum(dim=2) / inp.lengths.clamp_min(1).view(-1, 1, 1).float()).unsqueeze(2)
            center = center.expand(-1, -1, alpha.shape[2], -1)
        else:
            center = torch.einsum("rhgn,rhnd->rhgd", alpha, values)
        per_head = dense.output_error_from_center(alpha, values, center, per_row(self.option(inp, "eps"), 4,
                                                                                 torch.float32))
        return torch.linalg.vector_norm(per_head, dim=2)  # +inf stays +inf

    def scores(self, inp: EvictionInputs) -> Tensor:
        if self.caote_mode == "head":
            c = self._head_scores(inp)
        else:
            alpha = dense.normalise_mass(self.base.attention_mass(inp), inp.valid)
            eps = self.option(inp, "eps")
            if isinstance(eps, Tensor):  # per row: the kernels take one floor; the rest is applied here
                c = inp.ops.output_error(inp, alpha, self.fast, self.option_min(inp, "eps"))
                c = dense.floor_output_error(c, alpha, per_row(eps, 3, torch.float32))
            else:
                c = inp.ops.output_error(inp, alpha, self.fast, eps)
        return dense.protect(c, self.base.protected_mask(inp))


class FastCAOTE(CAOTE):
    name = "fastcaote"
    summary = "CAOTE with X replaced by the plain mean of the candidate values (cheaper, about as good)"
    fast = True
