"""CriticalKV (Feng et al., 2025): two-stage selection that accounts for what each kept value adds to the
layer output after the output projection.

Per token and KV head the policy keeps (spec criticalkv.md §2.4)

    nu_j = (1/G) * sum_{h in group} || v_j W_O^(h) ||_1

where ``W_O^(h)`` is query head h's slice of the output projection (columns ``h*d:(h+1)*d`` of the
``o_proj.weight`` matrix ``[hidden, H_q*d]``). ``nu`` depends only on the value and the weights, so it is
computed once, when the token enters the cache (``init_state``), and stored as state ``"nu"`` that the
engine compacts together with K and V.

Selection with budget b (spec §3.1): stage 1 spends ``b1 = floor(alpha*b)`` slots, the base's protected
tokens included, on the highest attention ``s1``; stage 2 fills the remaining ``b - max(b1, protected)``
slots with the highest ``(s1 + epsilon) * nu`` among the rest. The result is protected ∪ S1 ∪ S2, exactly
b per head.

``s1`` is the base's ``ranking_mass`` (the mass the base itself ranks by, before protection) expressed
as a mean over query rows (the paper averages its window rows so that ``epsilon`` stays small next to
it, spec §8.8): it is divided by the base's ``mass_rows(inp)``. A per-head constant does not change
stage 1, only how much ``epsilon`` weighs in stage 2. Over SnapKV this is the pooled mass of the tokens
before the window, the window's own columns dropped before pooling (spec §2.5 step 3, as the reference
implementation); CAOTE over SnapKV instead pools the whole axis (``attention_mass``, caote.md §3.1). Over
TOVA it is TOVA's own ranking: by default the mean over all query heads of the layer.

The paper's SnapKV uses max pooling with kernel 7 (spec §4); our SnapKV defaults to average pooling, so
to reproduce the paper pass ``pooling="max"`` (it goes to the base): ``criticalkv+snapkv`` with
``pooling="max"``. NVIDIA kvpress's ``CriticalKVPress(SnapKVPress(...))`` pools by average.
"""

from __future__ import annotations


import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, MetaPolicy, per_row
from vllm_evict.policies.options import check_float
from vllm_evict.policies.score_ops import DENSE, ScoreOps


def two_stage_keep(s1: Tensor, nu: Tensor, protected: Tensor, valid: Tensor, budget: Tensor, budget_max: int,
                   alpha: Tensor | float, epsilon: Tensor | float) -> Tensor:
    """CriticalKV's selection (spec §3.1), batched over rows and KV heads: kept slots [R, H, budget_max]
    as ``dense.topk_keep`` lays them out.

    s1, nu [R, H, N] fp32; protected bool [R, H, N]; valid [R, 1, N]; budget [R]. Ties keep the lower
    slot."""
    s1 = torch.nan_to_num(s1.float(), nan=0.0)
    neg_inf = torch.full_like(s1, float("-inf"))
    b = budget.view(-1, 1, 1)
    num_protected = protected.sum(dim=-1, keepdim=True)  # [R, H, 1]
    b1 = torch.floor(alpha * b.double()).long()
    k1 = (b1 - num_protected).clamp_min(0)
    k2 = (b - torch.maximum(num_protected, b1)).clamp_min(0)
    candidates = valid & ~protected
    stage1 = candidates & (dense.rank_descending(torch.where(candidates, s1, neg_inf)) < k1)
    s2 = torch.nan_to_num((s1 + epsilon) * nu.float(), nan=0.0)
    rest = candidates & ~stage1
    stage2 = rest & (dense.rank_descending(torch.where(rest, s2, neg_inf)) < k2)
    # protected > stage 1 > stage 2 > rest; a top-b over these priorities yields exactly b per head.
    priority = protected.float() * 3 + stage1.float() * 2 + stage2.float()
    return dense.topk_keep(priority, valid, budget, budget_max)


class CriticalKV(MetaPolicy):
    name = "criticalkv"
    summary = ("two-stage selection: alpha*budget by attention, the rest by (attention + epsilon) * "
               "||v W_O||_1 (value norm after the output projection)")
    paper = ("Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
             "Perspective (2025)")
    needs_o_proj = True
    state_names = ("nu",)
    computed_state = ("nu",)
    alpha: float = 0.5  # the share of the budget stage 1 fills by attention
    epsilon: float = 1e-4  # added to the stage-1 mean before it multiplies nu

    def check_options(self) -> None:
        check_float("alpha", self.alpha, low=0.0, high=1.0, low_open=True)
        check_float("epsilon", self.epsilon, low=0.0, high=1.0)

    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   ops: ScoreOps = DENSE) -> dict[str, Tensor]:
        if o_proj is None:
            raise ValueError("criticalkv needs the layer's output projection weight (o_proj) to compute "
                             "||v W_O||_1; the engine must pass o_proj to init_state")
        state = dict(self.base.init_state(new_keys, new_values, o_proj, ops))
        state["nu"] = ops.value_norms(new_values, o_proj)
        return state

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        state = dict(self.base.update_state(inp))
        if "nu" in inp.state:  # the base knows nothing of nu: carry it through unchanged
            state["nu"] = inp.state["nu"]
        return state

    def _nu(self, inp: EvictionInputs) -> Tensor:
        nu = inp.state.get("nu")
        if nu is None:
            raise ValueError("criticalkv needs state 'nu' for every candidate (computed by init_state "
                             "when tokens enter the cache)")
        return nu.float()

    def stage1_scores(self, inp: EvictionInputs) -> Tensor:
        """The base's ranking mass as a mean over its query rows, fp32 [R, H_kv, N]."""
        rows = self.base.mass_rows(inp).clamp_min(1).view(-1, 1, 1).float()
        return self.base.ranking_mass(inp).float() / rows

    def scores(self, inp: EvictionInputs) -> Tensor:
        """Budget-free ranking: the stage-2 score ``(s1 + epsilon) * nu`` with protected tokens at +inf.
        Selection (``select``) is the two-stage procedure, which this single score does not capture."""
        s2 = (self.stage1_scores(inp) + per_row(self.option(inp, "epsilon"), 3, torch.float32)) * self._nu(inp)
        return dense.protect(s2, self.base.protected_mask(inp))

    def select(self, inp: EvictionInputs) -> Tensor:
        return two_stage_keep(self.stage1_scores(inp), self._nu(inp), self.base.protected_mask(inp), inp.valid,
                              inp.budget, inp.budget_max, per_row(self.option(inp, "alpha")),
                              per_row(self.option(inp, "epsilon"), 3, torch.float32))
