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
it, spec §8.8): it is divided by ``mass_rows(inp)`` (see that function for what this means for each
base). A per-head constant does not change stage 1, only how much ``epsilon`` weighs in stage 2. Over
SnapKV this is the pooled mass of the tokens before the window, the window's own columns dropped
before pooling (spec §2.5 step 3, as the reference implementation); CAOTE over SnapKV instead pools
the whole axis (``attention_mass``, caote.md §3.1). Over TOVA it is TOVA's own ranking: by default the
mean over all query heads of the layer.

The paper's SnapKV uses max pooling with kernel 7 (spec §4); our SnapKV defaults to average pooling, so
to reproduce the paper pass ``pooling="max"`` (it goes to the base): ``criticalkv+snapkv`` with
``pooling="max"``. NVIDIA kvpress's ``CriticalKVPress(SnapKVPress(...))`` pools by average.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vllm_evict.policies.base import EvictionInputs, MetaPolicy, protect, topk_keep
from vllm_evict.policies.kernels import DENSE, ScoreKernels
from vllm_evict.policies.options import check_float

# Elements of the [H_kv, G, tokens, hidden] projected-value block materialised at once (64 MiB fp32).
_NU_BLOCK_ELEMENTS = 1 << 24


def projected_value_l1(values: Tensor, o_proj: Tensor | None) -> Tensor:
    """``nu`` [H_kv, m]: group mean over the query heads of ``||v_j W_O^(h)||_1`` (fp32).

    values [H_kv, m, d]; o_proj [hidden, H_q*d], as ``nn.Linear(H_q*d, hidden).weight``.
    Tokens go through in blocks so that the projected values of a long prefill chunk never exist at once.
    """
    if o_proj is None:
        raise ValueError("criticalkv needs the layer's output projection weight (o_proj) to compute "
                         "||v W_O||_1; the engine must pass o_proj to init_state")
    h_kv, m, d = values.shape
    if o_proj.dim() != 2 or o_proj.shape[1] % d != 0:
        raise ValueError(f"o_proj must be [hidden, H_q*{d}], got shape {tuple(o_proj.shape)}")
    h_q = o_proj.shape[1] // d
    if h_q % h_kv != 0:
        raise ValueError(f"o_proj has {h_q} query heads, not a multiple of the {h_kv} KV heads")
    group = h_q // h_kv
    hidden = o_proj.shape[0]
    # Column h*d + e of o_proj is entry e of query head h; query head h serves KV head h // group.
    weight = o_proj.to(device=values.device, dtype=torch.float32).view(hidden, h_kv, group, d)
    v = values.float()
    out = torch.empty(h_kv, m, dtype=torch.float32, device=values.device)
    block = max(1, _NU_BLOCK_ELEMENTS // max(1, h_q * hidden))
    for start in range(0, m, block):
        stop = min(start + block, m)
        projected = torch.einsum("kmd,okgd->kgmo", v[:, start:stop], weight)  # [H_kv, G, blk, hidden]
        out[:, start:stop] = projected.abs().sum(dim=-1).mean(dim=1)
    return out


def _ahakv_rows(base, inp: EvictionInputs) -> float:
    # Its mass sums SG-softmax rows over the last ``recent`` queries AND over the G heads of the group
    # (times a value prior in (0, 1]); in decode it keeps adding G rows per step, which this ignores.
    return min(base.recent, inp.queries.shape[1]) * inp.group_size


def _nacl_rows(base, inp: EvictionInputs) -> float:
    # Group mean of the column sums over its n_p proxy queries (n_p is derived per step).
    return base.proxy_count(inp)


# Base name -> rows its ranking_mass adds up, where the generic rule below does not fit.
_MASS_ROWS = {"ahakv": _ahakv_rows, "nacl": _nacl_rows}


def mass_rows(base, inp: EvictionInputs) -> float:
    """How many query rows the base's ``ranking_mass`` adds up (each softmax row sums to 1).

    - a base may say so itself with a ``mass_rows(inp)`` method (it wins);
    - ahakv: ``min(recent, queries) * G`` (it sums over the group too); nacl: its proxy count n_p;
    - other window bases (``query_window`` an int w > 0) sum the window queries they were given, at
      most w: ``min(w, inp.queries.shape[1])`` rows; snapkv sums its w window rows, tova reads one
      row (w = 1);
    - accumulating bases (``query_window`` None: h2o) sum every query the request has processed:
      ``inp.seq_len`` rows.
    """
    own = getattr(base, "mass_rows", None)
    if callable(own):
        rows = own(inp)
    elif getattr(base, "name", None) in _MASS_ROWS:
        rows = _MASS_ROWS[base.name](base, inp)
    elif base.query_window is None:
        rows = inp.seq_len
    else:
        rows = min(base.query_window, inp.queries.shape[1])
    return float(max(rows, 1))


def two_stage_keep(s1: Tensor, nu: Tensor, protected: Tensor, budget: int, alpha: float,
                   epsilon: float) -> Tensor:
    """CriticalKV's selection (spec §3.1), batched over KV heads: [H_kv, budget] ascending slot indices.

    s1, nu [H_kv, n] fp32; protected bool [H_kv, n]. Ties keep the lower slot, as ``topk_keep``.
    """
    n = s1.shape[-1]
    s1 = torch.nan_to_num(s1.float(), nan=0.0)
    num_protected = protected.sum(dim=-1, keepdim=True)  # [H_kv, 1]
    b1 = math.floor(alpha * budget)
    k1 = (b1 - num_protected).clamp_min(0)
    k2 = (budget - num_protected.clamp_min(b1)).clamp_min(0)
    neg_inf = torch.full_like(s1, float("-inf"))

    def ranks(score: Tensor) -> Tensor:
        """Rank of every slot under a stable descending sort (0 = best)."""
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices
        arange = torch.arange(n, device=score.device).expand_as(order)
        return torch.empty_like(order).scatter_(-1, order, arange)

    stage1 = ~protected & (ranks(torch.where(protected, neg_inf, s1)) < k1)
    s2 = torch.nan_to_num((s1 + epsilon) * nu.float(), nan=0.0)
    stage2 = ~protected & ~stage1 & (ranks(torch.where(protected | stage1, neg_inf, s2)) < k2)
    # protected > stage 1 > stage 2 > rest; a top-b over these priorities yields exactly b per head.
    priority = protected.float() * 3 + stage1.float() * 2 + stage2.float()
    return topk_keep(priority, budget)


class CriticalKV(MetaPolicy):
    name = "criticalkv"
    summary = ("two-stage selection: alpha*budget by attention, the rest by (attention + epsilon) * "
               "||v W_O||_1 (value norm after the output projection)")
    paper = ("Feng et al., Identify Critical KV Cache in LLM Inference from an Output Perturbation "
             "Perspective (2025)")
    needs_o_proj = True
    state_names = ("nu",)
    defaults = {"alpha": 0.5, "epsilon": 1e-4}

    def check_options(self) -> None:
        check_float("alpha", self.alpha, low=0.0, high=1.0, low_open=True)
        check_float("epsilon", self.epsilon, low=0.0)

    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   kernels: ScoreKernels = DENSE) -> dict[str, Tensor]:
        state = dict(self.base.init_state(new_keys, new_values, o_proj, kernels))
        state["nu"] = kernels.projected_value_norms(new_values, o_proj, state_name="nu")
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
        """The base's ranking mass as a mean over its query rows, fp32 [H_kv, n]."""
        return self.base.ranking_mass(inp).float() / mass_rows(self.base, inp)

    def scores(self, inp: EvictionInputs) -> Tensor:
        """Budget-free ranking: the stage-2 score ``(s1 + epsilon) * nu`` with protected tokens at +inf.
        Selection (``select``) is the two-stage procedure, which this single score does not capture."""
        s2 = (self.stage1_scores(inp) + self.epsilon) * self._nu(inp)
        return protect(s2, self.base.protected_mask(inp))

    def select(self, inp: EvictionInputs, budget: int) -> Tensor:
        return two_stage_keep(self.stage1_scores(inp), self._nu(inp), self.base.protected_mask(inp),
                              budget, self.alpha, self.epsilon)
