"""AhaKV (Gu et al., 2025): Recent Accumulation + Step-Gain softmax + Value-Prior Enhancement.

Spec: ahakv.md. Per KV head h, with the recommended resolutions ([R]) of the spec:

* prefill (§3.2-3.6): F_h = sum over the last r = ``recent`` queries and over the G query heads of
  the group of SG-softmax rows, i.e. softmax(eta * scale * q.k) with the length-adaptive gain
  lambda = sqrt(2 ln(i / k) / d) on the scaled logits (Algorithm 1 as written, ``gain="scaled"``; §3.3's
  derivation puts it on the raw q.k, eta = sqrt(2 ln(i / k)): ``gain="raw"``; i = logical length,
  k = budget, ln clamped at 0); F pooled along the positions as SnapKV pools its window mass (average,
  kernel 7, the window's own columns zeroed: ``pooling="avg"``, Fig. 3's "pooling smooths scores");
  value prior gamma_bar = avgpool(nu) / max(avgpool(nu)) with nu = |v|^2 (kernel ``value_kernel``,
  stride 1, same padding, count_include_pad=False, pooled in logical-position order);
  F_hat = gamma_bar * F. Keep the recent window plus the top F_hat. F_hat seeds the decode score.
  The two defaults (scaled gain, pooled F) are the readings the quality suite supports at small budgets
  (issue #30's ablation, docs/benchmarks/quality.md#ahakv-at-small-budgets); the derivation's gain with
  an unpooled F, the earlier default, lost the pass key at 6% of a 2k prompt.
* decode (§4, Algorithm 1 line 27): every step the SG-softmax row(s) of this step's query are added
  to the per-token ``score`` state (no value prior; new tokens start at 0). A decode eviction keeps
  the recent window plus the top ``score``.

State: ``vnorm`` (nu, raw squared value norm, from ``init_state``) and ``score`` (the decode
accumulator, seeded with F_hat at the end of the prompt and at every prefill eviction).

Which budget k enters the gain, per row: ``inp.budget`` on an evicting step; otherwise (most decode
steps) the physical cache size: under the shared schedule it equals the budget within one decode
slack once the cache has been evicted, and it gives the exact gain 0 at a prompt end that needs no
eviction (i <= k there).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import WINDOW_MASS, EvictionInputs, Phase, Policy, StepResult
from vllm_evict.policies.options import check_choice, check_int, check_odd_kernel
from vllm_evict.policies.score_ops import DENSE, ScoreOps


def sg_gain_host(length: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """``sg_gain`` on the host (the engine computes the window's gain when it records the queries)."""
    i, k = length.astype(np.float64), budget.astype(np.float64)
    ratio = np.where((i > 0) & (k > 0), i / np.maximum(k, 1.0), 1.0)
    return np.sqrt(2.0 * np.maximum(np.log(ratio), 0.0)).astype(np.float32)


GAINS = ("raw", "scaled", "none")
PRIORS = ("value", "none")
POOLINGS = ("none", "avg")


def sg_gain(length: Tensor, budget: Tensor) -> Tensor:
    """SG-softmax gain on the usual scaled logits, eta = sqrt(2 ln(i/k)) per row (spec §3.3, = lambda * sqrt(d)).

    ln(i/k) is clamped at 0: a row no longer than the budget gets gain 0 (a uniform row) [R]."""
    i, k = length.double(), budget.double()
    ratio = torch.where((i > 0) & (k > 0), i / k.clamp_min(1), torch.ones_like(i))
    return torch.sqrt(2.0 * torch.log(ratio).clamp_min(0.0)).float()


def value_prior(vnorm: Tensor, positions: Tensor, valid: Tensor, kernel: Tensor | int,
                kernel_max: int | None = None) -> Tensor:
    """gamma_bar [R, H_kv, N]: nu average-pooled along the logical order, divided by its per-head max (§3.5).

    Stride 1, 'same' padding, and the border windows average only the tokens that exist
    (count_include_pad=False). A head whose values are all zero gets gamma_bar = 0."""
    gamma = dense.mean_pool_in_position_order(vnorm, positions, valid, kernel, kernel_max)
    peak = gamma.amax(dim=-1, keepdim=True)
    return torch.where(peak > 0, gamma / peak.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(gamma))


class AhaKV(Policy):
    name = "ahakv"
    summary = "SG-softmax attention of the last `recent` queries times a pooled value-norm prior; decode accumulates"
    paper = "Gu et al., AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction (2025)"
    one_shot = True
    is_attention_mass = True
    state_names = ("vnorm", "score", WINDOW_MASS)
    computed_state = ("vnorm",)
    needs_every_step = True  # decode accumulates every step's SG-softmax row
    window_at_prompt_end = True  # the prompt's last r queries seed the decode score, evicting or not
    window_in_decode = False  # decode evictions rank by the accumulated score, not by a window
    recent: int = 32  # the observation window r = B_r, whose tokens are also kept
    value_kernel: int = 5  # odd average-pooling kernel of the value prior
    sinks: int = 0
    gain: str = "scaled"  # what the paper's lambda multiplies: the "scaled" logits, the "raw" q.k, or "none"
    prior: str = "value"  # the value prior gamma_bar on F (§3.5), or "none" (the paper's 'w/o VPE' ablation)
    pooling: str = "avg"  # F pooled as SnapKV pools its window mass (spec §9.7), or "none"
    kernel: int = 7  # odd kernel of that pooling (SnapKV's)

    @property
    def query_window(self) -> int:
        return self.recent  # the observation window r = B_r (§3.2 [R])

    def check_options(self) -> None:
        check_int("recent", self.recent, minimum=1)
        check_odd_kernel("value_kernel", self.value_kernel)
        check_int("sinks", self.sinks)
        check_choice("gain", self.gain, GAINS)
        check_choice("prior", self.prior, PRIORS)
        check_choice("pooling", self.pooling, POOLINGS)
        check_odd_kernel("kernel", self.kernel)

    def protected_count(self, budget: int) -> int:
        return self.recent + self.sinks

    def window_gain(self, seq_len: np.ndarray, budget: np.ndarray, head_size: int) -> np.ndarray | None:
        if self.gain == "none":
            return None
        eta = sg_gain_host(seq_len, budget)
        return eta / np.float32(math.sqrt(head_size)) if self.gain == "scaled" else eta

    # ---- per-token state -----------------------------------------------------------------
    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   ops: ScoreOps = DENSE) -> dict[str, Tensor]:
        return {"vnorm": new_values.float().pow(2).sum(dim=-1)}  # nu = |v|^2 in fp32 (§3.7); score starts at 0

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """The score seeded with F_hat at a prompt end or a prefill eviction, accumulated in decode."""
        state = self._full_state(inp)
        if inp.phase is Phase.DECODE:
            state["score"] = state["score"] + self.decode_increment(inp)
        elif inp.phase is Phase.PROMPT_END or inp.evicting:
            state["score"] = self.refined_score(inp)
        return state

    def step(self, inp: EvictionInputs) -> StepResult:
        """Update the score, then, when evicting, keep the protected tokens plus the top of that score."""
        state = self.update_state(inp)
        if not inp.evicting:
            return StepResult(state=state, keep=None)
        scores = dense.protect(state["score"], self.protected_mask(inp))
        return StepResult(state=state, keep=dense.topk_keep(scores, inp.valid, inp.budget, inp.budget_max))

    def _full_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """The state dict with both entries present (inputs built without state get them from K/V)."""
        state = dict(inp.state)
        if "vnorm" not in state:
            state["vnorm"] = inp.values.float().pow(2).sum(dim=-1)
        if "score" not in state:
            state["score"] = inp.zeros()
        return state

    # ---- scoring ---------------------------------------------------------------------------
    def logit_gain(self, inp: EvictionInputs) -> Tensor | None:
        """The factor on the scaled logits q.k/sqrt(d), per row (None: 1, a plain softmax), by ``gain``:
        ``raw``: lambda = sqrt(2 ln(i/k) / d) times the raw q.k (Eq. 12 as derived), i.e. eta = sqrt(2 ln(i/k));
        ``scaled``: lambda times the already-scaled logits (Algorithm 1 read literally), eta = lambda;
        ``none``: no gain. i = the logical length, k = the budget (see the module docstring)."""
        if self.gain == "none":
            return None
        k = inp.budget if inp.budget is not None else inp.lengths
        eta = sg_gain(inp.seq_len, k)
        if self.gain == "scaled":
            eta = eta / math.sqrt(inp.queries.shape[-1])
        return eta

    def window_score(self, inp: EvictionInputs) -> Tensor:
        """F [R, H_kv, N]: SG-softmax rows of the last r queries, summed over rows and the GQA group (§3.4, §3.6)."""
        return inp.window_mass(count=self.option(inp, "recent"), gain=self.logit_gain(inp))

    def refined_score(self, inp: EvictionInputs) -> Tensor:
        """F_hat = gamma_bar * F (Eq. 15), fp32 [R, H_kv, N], finite and non-negative. With ``pooling``
        "avg", F is first smoothed as SnapKV smooths its window mass; with ``prior`` "none", F_hat = F."""
        score = self.window_score(inp)
        if self.pooling != "none":
            # As SnapKV: the window's own columns (kept anyway) are zeroed first, so that their mass does not
            # spill onto the tokens just before the window.
            window = dense.recent_mask(inp.positions, inp.valid, self.option(inp, "recent"))
            score = dense.pool_in_position_order(score.masked_fill(window, 0.0), inp.positions, inp.valid,
                                                 self.option(inp, "kernel"), self.pooling,
                                                 self.option_max(inp, "kernel"))
        if self.prior == "none":
            return score
        vnorm = self._full_state(inp)["vnorm"]
        kernel, widest = self.option(inp, "value_kernel"), self.option_max(inp, "value_kernel")
        return value_prior(vnorm, inp.positions, inp.valid, kernel, widest) * score

    def decode_increment(self, inp: EvictionInputs) -> Tensor:
        """SG-softmax row(s) of this step's queries (the last ``num_new``), summed over the group."""
        return inp.ops.window_mass(inp, query_positions=inp.latest_query_positions(inp.num_new), gain=self.logit_gain(inp))

    def ranking(self, inp: EvictionInputs) -> Tensor:
        """What a selection ranks by: F_hat in a prompt phase, the accumulated ``score`` in decode.

        As everywhere in the contract, ``inp.state`` is the state after this step's update, so the
        decode score already holds this step's increment."""
        if inp.phase is Phase.DECODE:
            return self._full_state(inp)["score"]
        return self.refined_score(inp)

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        return self.ranking(inp).clamp_min(0.0).masked_fill(~inp.valid, 0.0)

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """Its mass sums SG-softmax rows over the last ``recent`` queries AND over the G heads of the group
        (times a value prior in (0, 1]); in decode it keeps adding G rows per step, which this ignores."""
        if inp.window_count is None:
            rows = (inp.latest_query_positions(self.option(inp, "recent")) >= 0).sum(dim=-1)
        elif inp.phase is Phase.DECODE:  # the engine keeps no decode window for AhaKV: r rows, as above
            recent = self.option(inp, "recent")
            rows = torch.minimum(inp.seq_len, recent) if isinstance(recent, torch.Tensor) else inp.seq_len.clamp(max=recent)
        else:
            rows = inp.window_count
        return rows * inp.group_size

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        valid = inp.valid
        return (dense.recent_mask(inp.positions, valid, self.option(inp, "recent"))
                | dense.sink_mask(inp.positions, valid, self.option(inp, "sinks")))

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(self.ranking(inp), self.protected_mask(inp))
