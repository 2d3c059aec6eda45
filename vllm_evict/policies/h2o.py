"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023): keep the tokens that have received the most attention,
plus the most recent ones.

The score of a token is the attention it has accumulated from every query that has seen it since it
entered the cache, GQA group mean (spec caote.md §3.1 and §9.4, keydiff.md §8). The accumulator is
updated at every step, also before the cache is full, and travels with the KV slots as state "acc".

Defaults follow the H2O paper and its released code: the budget is split evenly between heavy hitters
and the most recent tokens (``recent=None``: half the budget, the paper's equal heavy/recent ratios), the
scores are the raw accumulated sums, and the cache is evicted once the whole prompt has been processed
(one-shot; the release runs the prompt in one forward, then drops to the budget, then evicts while
decoding). Options: ``recent`` (an int fixes the window; 0 is the CAOTE/KeyDiff harness, which protects
nothing), ``accumulate="mean"`` (each sum divided by the number of queries that could see the token,
seq_len - position: NVIDIA kvpress's observed-attention press, which favours late tokens less than raw
sums favour early ones) and ``sinks``.
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent
from vllm_evict.policies.options import check_choice, check_int

ACCUMULATE = ("sum", "mean")


class H2O(SinksAndRecent):
    name = "h2o"
    summary = "attention accumulated over every query since a token arrived (heavy hitters) plus recent tokens"
    paper = "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (2023)"
    one_shot = True
    is_attention_mass = True
    state_names = ("acc",)
    # Every step's queries must be added, including steps on which nothing is evicted.
    needs_every_step = True
    recent: int | None = None  # type: ignore[assignment]  # None: half the budget (the paper's split)
    accumulate: str = "sum"  # "sum" (the paper) or "mean" (per query that could see the token: kvpress)

    @property
    def query_window(self) -> None:
        return None  # all queries of the current step, each counted exactly once

    def check_options(self) -> None:
        if self.recent is not None:
            check_int("recent", self.recent)
        check_int("sinks", self.sinks)
        check_choice("accumulate", self.accumulate, ACCUMULATE)

    def recent_for(self, budget: int) -> int:
        """The recent window at ``budget``: the option, or half the budget."""
        return budget // 2 if self.recent is None else self.recent

    def protected_count(self, budget: int) -> int:
        return self.sinks + self.recent_for(budget)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        valid = inp.valid
        if self.recent is not None:
            recent: Tensor | int = self.option(inp, "recent")
        else:  # half of each row's budget; a step that evicts nothing protects nothing
            recent = inp.budget // 2 if inp.budget is not None else 0
        return dense.recent_mask(inp.positions, valid, recent) | dense.sink_mask(inp.positions, valid,
                                                                                 self.option(inp, "sinks"))

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """acc_j += (1/G) sum_g sum_i A^(g)_ij over this step's queries i.

        Tokens of this step arrive with acc = 0 and pick up their own block's attention here; the
        causal mask (by logical position) keeps earlier queries off later tokens.
        """
        mean = inp.ops.window_mass(inp) / inp.group_size
        # Out of place: the caller's state must survive if this step is retried or compared.
        return {**inp.state, "acc": inp.state["acc"].float() + mean}

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        acc = inp.state["acc"].float()
        if self.accumulate == "mean":
            # Every query since the token entered has been added: those at positions pos..seq_len-1.
            seen = (inp.seq_len.view(-1, 1, 1) - inp.positions.long()).clamp_min(1)
            acc = acc / seen
        return acc.masked_fill(~inp.valid, 0.0)

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """Every query the request has processed (a sum), or one (a mean per query)."""
        if self.accumulate == "mean":
            return inp.seq_len.clamp_min(1).new_ones(inp.seq_len.shape)
        return inp.seq_len.clamp_min(1)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(self.attention_mass(inp), self.protected_mask(inp))
