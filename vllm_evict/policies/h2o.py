"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023): keep the tokens that have received the most attention.

The score of a token is the attention it has accumulated from every query that has seen it since it
entered the cache, GQA group mean (spec caote.md §3.1 and §9.4, keydiff.md §8). The accumulator is
updated at every step, also before the cache is full, and travels with the KV slots as state "acc".
The harness the papers compare against protects nothing; the original H2O's recent window and
attention sinks are available as options (default 0).
"""

from __future__ import annotations

from torch import Tensor

from vllm_evict import dense
from vllm_evict.policies.base import EvictionInputs, SinksAndRecent


class H2O(SinksAndRecent):
    name = "h2o"
    summary = "attention accumulated over every query since a token arrived (heavy hitters)"
    paper = "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs (2023)"
    one_shot = False
    is_attention_mass = True
    state_names = ("acc",)
    # Every step's queries must be added, including steps on which nothing is evicted.
    needs_every_step = True

    @property
    def query_window(self) -> None:
        return None  # all queries of the current step, each counted exactly once

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """acc_j += (1/G) sum_g sum_i A^(g)_ij over this step's queries i.

        Tokens of this step arrive with acc = 0 and pick up their own block's attention here; the
        causal mask (by logical position) keeps earlier queries off later tokens.
        """
        mean = inp.ops.window_mass(inp) / inp.group_size
        # Out of place: the caller's state must survive if this step is retried or compared.
        return {**inp.state, "acc": inp.state["acc"].float() + mean}

    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        return inp.state["acc"].float().masked_fill(~inp.valid, 0.0)

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """Every query the request has processed."""
        return inp.seq_len.clamp_min(1)

    def scores(self, inp: EvictionInputs) -> Tensor:
        return dense.protect(self.attention_mass(inp), self.protected_mask(inp))
