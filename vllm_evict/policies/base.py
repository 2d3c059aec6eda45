"""The contract every eviction policy implements.

A policy is a pure function of one (layer, sequence): it reads the candidate keys/values of every KV
head, the observation-window queries and the per-token state, and returns per-head scores, a new
state, and (when asked to) the kept slot indices. It knows nothing about pages, block tables or
vLLM: the engine and the HF reference runner gather the tensors and compact the survivors.

Shapes (one layer, one sequence):
    keys, values      [H_kv, n, d]   candidates in slot order (post-RoPE keys), this step's tokens included
    positions         [H_kv, n]      logical position of each candidate (int64)
    queries           [H_q, w, d]    observation-window queries (post-RoPE), oldest first
    query_positions   [w]            logical positions of those queries (int64)
    state[name]       [H_kv, n]      persistent per-token state (fp32), compacted together with K and V
Query head g belongs to KV head g // (H_q // H_kv), as in every GQA model.

``keys`` and ``values`` may be given as a ``Deferred`` loader instead of a tensor: the engine does so,
and its paged ``inp.kernels`` (see kernels.py) computes the heavy scores without them, so K and V are
gathered out of the paged cache only by a policy that actually reads them.
"""

from __future__ import annotations

import copy
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from vllm_evict.policies.kernels import DENSE, ScoreKernels


class Phase(str, enum.Enum):
    """Where in a request's life the current step is."""

    PREFILL = "prefill"  # a prompt chunk that is not the last one
    PROMPT_END = "prompt_end"  # the chunk that completes the prompt
    DECODE = "decode"  # generated tokens only


class Deferred:
    """A tensor computed on first use and then remembered (shared by copies of the inputs)."""

    def __init__(self, load: Callable[[], Tensor]) -> None:
        self._load: Callable[[], Tensor] | None = load
        self._value: Tensor | None = None

    def __call__(self) -> Tensor:
        if self._load is not None:
            self._value, self._load = self._load(), None
        assert self._value is not None
        return self._value


class _TensorOrDeferred:
    """Dataclass field holding a Tensor or a ``Deferred``; reading it always yields the Tensor."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Tensor:
        if obj is None:
            raise AttributeError(self.name)  # so that dataclass sees a required field, not a default
        value = obj.__dict__[self.slot]
        return value() if isinstance(value, Deferred) else value

    def __set__(self, obj: Any, value: "Tensor | Deferred") -> None:
        obj.__dict__[self.slot] = value


@dataclass
class EvictionInputs:
    keys: Tensor = _TensorOrDeferred()  # type: ignore[assignment]
    values: Tensor = _TensorOrDeferred()  # type: ignore[assignment]
    positions: Tensor
    queries: Tensor
    query_positions: Tensor
    scale: float
    seq_len: int  # logical tokens seen so far, this step's included
    num_new: int  # candidates added this step (the last ``num_new`` slots)
    phase: Phase = Phase.PREFILL
    state: dict[str, Tensor] = field(default_factory=dict)
    layer: int = 0
    seed: int = 0  # per-request seed; policies derive per-(layer, head) streams from it
    o_proj: Tensor | None = None  # [hidden, H_q * d] output projection, for policies that need it
    budget: int | None = None  # tokens this step keeps per head (None: no eviction); set by ``step``
    kernels: ScoreKernels = DENSE  # where the heavy score arithmetic runs (the engine's reads its pages)

    # Shapes come from ``positions``, which is always a tensor, so asking them loads nothing.
    @property
    def num_kv_heads(self) -> int:
        return self.positions.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]

    @property
    def group_size(self) -> int:
        return self.queries.shape[0] // self.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def evolve(self, **changes: Any) -> "EvictionInputs":
        """A copy with some fields changed; unlike ``dataclasses.replace`` it loads nothing deferred."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def with_state(self, state: dict[str, Tensor]) -> "EvictionInputs":
        return self.evolve(state=state)


@dataclass
class StepResult:
    state: dict[str, Tensor]  # full state over the n candidates (before compaction)
    keep: Tensor | None = None  # [H_kv, budget] kept slot indices, ascending per head


class Policy(ABC):
    """Base class. Subclasses set the class variables and implement ``scores``.

    ``scores`` returns fp32 [H_kv, n]: higher means keep; +inf marks protected tokens.
    The default ``select`` keeps the ``budget`` highest scores per head, ties going to the lower slot.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    # The schedule the method's paper uses: evict once after the prompt, or block-wise while prefilling.
    one_shot: ClassVar[bool] = False
    # True when ``attention_mass`` returns a non-negative attention-like mass (usable under caote/criticalkv).
    is_attention_mass: ClassVar[bool] = False
    # Names of the per-token state tensors this policy keeps next to the KV cache.
    state_names: ClassVar[tuple[str, ...]] = ()
    # True when ``update_state`` must run on every step, not only when evicting.
    needs_every_step: ClassVar[bool] = False
    needs_o_proj: ClassVar[bool] = False
    # Option name -> default. ``from_spec`` validates user options against these.
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, **options: Any) -> None:
        self.options = {**self.defaults, **options}
        for key, value in self.options.items():
            setattr(self, key, value)

    # ---- what the engine needs to know -------------------------------------------------
    @property
    def query_window(self) -> int | None:
        """How many of the most recent queries the policy reads.

        An int w: the last w queries of the request (the engine keeps a ring buffer across decode
        steps). ``None``: exactly the queries of the current step (H2O accumulates all of them).
        0: no queries at all.
        """
        return 0

    def protected_count(self, budget: int) -> int:
        """Tokens this policy always keeps; ``from_spec`` checks it fits in the budget."""
        return 0

    def check_options(self) -> None:
        """Raise ValueError (see ``options.py``) for option values this policy cannot work with."""

    def validate(self, budget: int) -> None:
        """Raise ValueError for options that do not fit this ``budget`` (beyond ``protected_count``)."""

    # ---- per-token state -----------------------------------------------------------------
    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   kernels: ScoreKernels = DENSE) -> dict[str, Tensor]:
        """State of tokens entering the cache ([H_kv, m, d] each) -> {name: [H_kv, m]}."""
        h, m = new_values.shape[0], new_values.shape[1]
        return {name: torch.zeros(h, m, dtype=torch.float32, device=new_values.device) for name in self.state_names}

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """Per-step state update over all n candidates (e.g. H2O accumulation). Default: unchanged."""
        return inp.state

    # ---- scoring and selection -----------------------------------------------------------
    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        """Finite, non-negative attention-like mass [H_kv, n] (only for ``is_attention_mass`` policies)."""
        raise NotImplementedError(f"{self.name} has no attention-mass score")

    def ranking_mass(self, inp: EvictionInputs) -> Tensor:
        """The attention mass this policy ranks its unprotected tokens by: its ``scores`` before protection.

        CriticalKV's stage 1 reads this; CAOTE reads ``attention_mass``. They differ where the method's
        own ranking is not the per-KV-head output weight CAOTE needs (SnapKV, TOVA); default: the same.
        """
        return self.attention_mass(inp)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        """Bool [H_kv, n]: tokens that are always kept. Default: none."""
        return torch.zeros(inp.positions.shape, dtype=torch.bool, device=inp.device)

    @abstractmethod
    def scores(self, inp: EvictionInputs) -> Tensor:
        """fp32 [H_kv, n]; higher is kept; +inf for protected tokens."""

    def select(self, inp: EvictionInputs, budget: int) -> Tensor:
        return topk_keep(self.scores(inp), budget)

    def step(self, inp: EvictionInputs, budget: int | None) -> StepResult:
        """One step for one layer: update state, and if ``budget`` is given, choose the survivors."""
        inp = inp.evolve(budget=budget)
        state = self.update_state(inp) if (self.needs_every_step or budget is not None) else inp.state
        if budget is None or budget >= inp.num_tokens:
            return StepResult(state=state, keep=None)
        keep = self.select(inp.with_state(state), budget)
        return StepResult(state=state, keep=keep)


def topk_keep(scores: Tensor, budget: int) -> Tensor:
    """Indices of the ``budget`` highest scores per row, ascending; ties keep the lower index.

    A stable descending sort gives the deterministic tie-break that the kernels reproduce.
    NaN scores rank lowest.
    """
    s = torch.nan_to_num(scores.float(), nan=float("-inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :budget]
    return torch.sort(order, dim=-1).values


def protect(scores: Tensor, mask: Tensor) -> Tensor:
    """Give protected tokens +inf so every top-k keeps them."""
    return torch.where(mask, torch.full_like(scores, float("inf")), scores)


def recent_mask(positions: Tensor, count: int) -> Tensor:
    """Bool [H_kv, n]: the ``count`` candidates with the largest logical positions, per head."""
    if count <= 0:
        return torch.zeros_like(positions, dtype=torch.bool)
    threshold = positions.max(dim=-1, keepdim=True).values - count
    return positions > threshold


def sink_mask(positions: Tensor, count: int) -> Tensor:
    """Bool [H_kv, n]: candidates among the first ``count`` logical positions."""
    return positions < count


def compact(tensor: Tensor, keep: Tensor) -> Tensor:
    """Gather kept slots: tensor [H_kv, n, ...] with keep [H_kv, b] -> [H_kv, b, ...]."""
    index = keep
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    index = index.expand(*keep.shape, *tensor.shape[2:])
    return torch.gather(tensor, 1, index)


class SinksAndRecent(Policy):
    """A policy whose only protected tokens are the optional first ``sinks`` and last ``recent``
    logical positions (both off by default, as in the papers' harness)."""

    defaults: ClassVar[dict[str, Any]] = {"recent": 0, "sinks": 0}

    def check_options(self) -> None:
        from vllm_evict.policies.options import check_int

        check_int("recent", self.recent)
        check_int("sinks", self.sinks)

    def protected_count(self, budget: int) -> int:
        return self.sinks + self.recent

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return recent_mask(inp.positions, self.recent) | sink_mask(inp.positions, self.sinks)


class MetaPolicy(Policy):
    """A score computed on top of a base policy's attention mass (CAOTE, CriticalKV).

    Everything except the scoring and selection is delegated to the base: its queries, protected
    tokens, per-token state and schedule.
    """

    def __init__(self, base: Policy, **options: Any) -> None:
        super().__init__(**options)
        self.base = base
        self.one_shot = base.one_shot
        self.is_attention_mass = False
        self.needs_every_step = base.needs_every_step or type(self).needs_every_step
        self.needs_o_proj = base.needs_o_proj or type(self).needs_o_proj
        self.state_names = tuple(dict.fromkeys(base.state_names + type(self).state_names))

    @classmethod
    def accepts(cls, base_cls: type[Policy]) -> bool:
        return bool(base_cls.is_attention_mass)

    @property
    def query_window(self) -> int | None:
        return self.base.query_window

    def protected_count(self, budget: int) -> int:
        return self.base.protected_count(budget)

    def validate(self, budget: int) -> None:
        self.base.validate(budget)

    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   kernels: ScoreKernels = DENSE) -> dict[str, Tensor]:
        return self.base.init_state(new_keys, new_values, o_proj, kernels)

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        return self.base.update_state(inp)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return self.base.protected_mask(inp)
