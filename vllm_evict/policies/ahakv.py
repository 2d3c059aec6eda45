"""AhaKV (Gu et al., 2025): Recent Accumulation + Step-Gain softmax + Value-Prior Enhancement.

Spec: ahakv.md. Per KV head h, with the recommended resolutions ([R]) of the spec:

* prefill (§3.2-3.6): F_h = sum over the last r = ``recent`` queries and over the G query heads of
  the group of SG-softmax rows, i.e. softmax(eta * scale * q.k) with the length-adaptive gain
  eta = sqrt(2 ln(i / k)) (§3.3; i = logical length, k = budget, ln clamped at 0);
  value prior gamma_bar = avgpool(nu) / max(avgpool(nu)) with nu = |v|^2 (kernel ``value_kernel``,
  stride 1, same padding, count_include_pad=False, pooled in logical-position order);
  F_hat = gamma_bar * F. Keep the recent window plus the top F_hat. F_hat seeds the decode score.
* decode (§4, Algorithm 1 line 27): every step the SG-softmax row(s) of this step's query are added
  to the per-token ``score`` state (no value prior; new tokens start at 0). A decode eviction keeps
  the recent window plus the top ``score``.

State: ``vnorm`` (nu, raw squared value norm, from ``init_state``) and ``score`` (the decode
accumulator, seeded with F_hat at the end of the prompt and at every prefill eviction).

Which budget k enters the gain: the ``budget`` given to ``step`` when it is evicting. Steps that do
not evict (most decode steps) and calls that get no budget (``scores``, ``attention_mass``,
``update_state``, as used by CAOTE/CriticalKV) read ``inp.budget`` (set on evicting steps), and
otherwise fall back to the physical cache size: under the shared schedule it equals the budget
within one decode slack once the cache has been evicted, and it gives the exact gain 0 at a prompt
end that needs no eviction (i <= k there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_evict.policies.attention import order_by_position
from vllm_evict.policies.base import (
    EvictionInputs, Phase, Policy, StepResult, protect, recent_mask, sink_mask, topk_keep,
)
from vllm_evict.policies.kernels import DENSE, ScoreKernels
from vllm_evict.policies.options import check_int, check_odd_kernel


def sg_gain(length: int, budget: int) -> float:
    """SG-softmax gain on the usual scaled logits, eta = sqrt(2 ln(i/k)) (spec §3.3, = lambda * sqrt(d)).

    ln(i/k) is clamped at 0: a row no longer than the budget gets gain 0 (a uniform row) [R].
    """
    if length <= 0 or budget <= 0:
        return 0.0
    return math.sqrt(2.0 * max(math.log(length / budget), 0.0))


def value_prior(vnorm: Tensor, positions: Tensor, kernel: int) -> Tensor:
    """gamma_bar [H_kv, n]: nu average-pooled along the logical order, divided by its per-head max (§3.5).

    Stride 1, 'same' padding, and the border windows average only the tokens that exist
    (count_include_pad=False). A head whose values are all zero gets gamma_bar = 0.
    """
    order = order_by_position(positions)
    ordered = torch.gather(vnorm.float(), -1, order)
    pooled = F.avg_pool1d(ordered.unsqueeze(1), kernel, stride=1, padding=kernel // 2,
                          count_include_pad=False).squeeze(1)
    gamma = torch.empty_like(pooled).scatter_(-1, order, pooled)
    peak = gamma.amax(dim=-1, keepdim=True)
    return torch.where(peak > 0, gamma / peak.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(gamma))


class AhaKV(Policy):
    name = "ahakv"
    summary = "SG-softmax attention of the last `recent` queries times a pooled value-norm prior; decode accumulates"
    paper = "Gu et al., AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction (2025)"
    one_shot = True
    is_attention_mass = True
    state_names = ("vnorm", "score")
    needs_every_step = True  # decode accumulates every step's SG-softmax row
    defaults = {"recent": 32, "value_kernel": 5, "sinks": 0}

    @property
    def query_window(self) -> int:
        return self.recent  # the observation window r = B_r (§3.2 [R])

    def check_options(self) -> None:
        check_int("recent", self.recent, minimum=1)
        check_odd_kernel("value_kernel", self.value_kernel)
        check_int("sinks", self.sinks)

    def protected_count(self, budget: int) -> int:
        return self.recent + self.sinks

    # ---- per-token state -----------------------------------------------------------------
    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   kernels: ScoreKernels = DENSE) -> dict[str, Tensor]:
        vnorm = new_values.float().pow(2).sum(dim=-1)  # nu = |v|^2 in fp32 (§3.7)
        return {"vnorm": vnorm, "score": torch.zeros_like(vnorm)}

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        return self._next_state(inp, None)

    def step(self, inp: EvictionInputs, budget: int | None) -> StepResult:
        """Update the score (seed it with F_hat at a prompt end / prefill eviction, accumulate in decode),
        then, when evicting, keep the protected tokens plus the top of that score."""
        inp = inp.evolve(budget=budget)
        state = self._next_state(inp, budget)
        if budget is None or budget >= inp.num_tokens:
            return StepResult(state=state, keep=None)
        keep = topk_keep(protect(state["score"], self.protected_mask(inp)), budget)
        return StepResult(state=state, keep=keep)

    def _next_state(self, inp: EvictionInputs, budget: int | None) -> dict[str, Tensor]:
        state = self._full_state(inp)
        if inp.phase is Phase.DECODE:
            state["score"] = state["score"] + self.decode_increment(inp, budget)
        elif inp.phase is Phase.PROMPT_END or budget is not None:
            state["score"] = self.refined_score(inp, budget)
        return state

    def _full_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """The state dict with both entries present (inputs built without state get them from K/V)."""
        state = dict(inp.state)
        if "vnorm" not in state:
            state["vnorm"] = inp.values.float().pow(2).sum(dim=-1)
        if "score" not in state:
            state["score"] = torch.zeros(inp.positions.shape, dtype=torch.float32, device=inp.device)
        return state

    # ---- scoring ---------------------------------------------------------------------------
    def gain(self, inp: EvictionInputs, budget: int | None = None) -> float:
        """eta for this step: i = the logical length, k = the budget (see the module docstring)."""
        k = budget if budget is not None else inp.budget
        if k is None:
            k = inp.num_tokens
        return sg_gain(inp.seq_len, k)

    def window_score(self, inp: EvictionInputs, budget: int | None = None) -> Tensor:
        """F [H_kv, n]: SG-softmax rows of the last r queries, summed over rows and the GQA group (§3.4, §3.6)."""
        q = inp.queries[:, -self.recent:]
        qpos = inp.query_positions[-self.recent:]
        return inp.kernels.column_sums(inp, q, qpos, gain=self.gain(inp, budget))

    def refined_score(self, inp: EvictionInputs, budget: int | None = None) -> Tensor:
        """F_hat = gamma_bar * F (Eq. 15), fp32 [H_kv, n], finite and non-negative."""
        vnorm = self._full_state(inp)["vnorm"]
        return value_prior(vnorm, inp.positions, self.value_kernel) * self.window_score(inp, budget)

    def decode_increment(self, inp: EvictionInputs, budget: int | None = None) -> Tensor:
        """SG-softmax row(s) of this step's query (the last ``num_new`` queries), summed over the group."""
        m = min(inp.num_new, inp.queries.shape[1])
        if m <= 0:
            return torch.zeros(inp.positions.shape, dtype=torch.float32, device=inp.device)
        q = inp.queries[:, inp.queries.shape[1] - m:]
        qpos = inp.query_positions[inp.query_positions.shape[0] - m:]
        return inp.kernels.column_sums(inp, q, qpos, gain=self.gain(inp, budget))

    def ranking(self, inp: EvictionInputs) -> Tensor:
        """What a selection ranks by: F_hat in a prompt phase, the accumulated ``score`` in decode.

        As everywhere in the contract, ``inp.state`` is the state after this step's update, so the
        decode score already holds this step's increment.
        """
        if inp.phase is Phase.DECODE:
            return self._full_state(inp)["score"]
        return self.refined_score(inp)

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        return self.ranking(inp).clamp_min(0.0)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return recent_mask(inp.positions, self.recent) | sink_mask(inp.positions, self.sinks)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return protect(self.ranking(inp), self.protected_mask(inp))
