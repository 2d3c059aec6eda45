"""The policy contract: pure functions from one layer's candidates to per-head scores and kept slots.

A policy sees R requests (rows) of one layer that share the policy and the phase, padded to N
candidate slots (``vllm_evict.dense`` documents the padding convention). Per row and KV head:

- ``positions`` [R, H_kv, N]     logical position of each slot (RoPE stays logical)
- ``keys``/``values`` [R, H_kv, N, d] the cached post-RoPE keys and the values of the candidates
- ``queries`` [R, H_q, W, d]     the row's most recent queries (``query_window`` of them), any order,
  with ``query_positions`` [R, W] (-1: no query in that entry)
- ``state[name]`` [R, H_kv, N]   persistent per-token state (fp32), compacted together with K and V

The observation window. A policy reads the attention mass of its window queries through
``inp.window_mass(...)``, never from ``queries`` directly. Dense callers (the tests, the kernels'
references) hand over the window's queries and the mass is computed from them. The engine keeps no
queries for fixed-mode requests: it accumulates each window query's softmax row into the per-token
state ``WINDOW_MASS`` when the query is computed (the keys it sees are exactly those it would see later,
since nothing is evicted in between), following the policy's ``window_size`` / ``window_gain``, and
sets ``window_count``; ``window_mass`` then returns that state. Its ``queries`` are then this step's
own queries (what ``update_state`` of H2O and of AhaKV's decode reads). A decoding request the scheduler
has lent pages of the KV pool keeps its window's queries there instead, and the engine computes the same
state once, from them, in the step that reads the window; the policy sees no difference.

Query head g belongs to KV head g // (H_q // H_kv), as in every GQA model (under tensor parallelism
with more ranks than KV heads, ``queries`` holds this rank's share of the group: see ``kv_replicas``).
Per-row numbers
(``seq_len``, ``num_new``, ``budget``, ``seed``) are [R] tensors, so one call serves a whole batch; the
engine groups rows by (policy, phase) on the host.

``keys`` and ``values`` may be given as a ``Deferred`` loader instead of a tensor: the engine does so,
and its paged ``inp.ops`` (see score_ops.py) computes the heavy scores without them, so K and V are
gathered out of the paged cache only by a policy that actually reads them.
"""

from __future__ import annotations

import copy
import enum
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

import numpy as np

from vllm_evict import dense
from vllm_evict.policies.score_ops import DENSE, ScoreOps

# Per-token states the engine accumulates for the observation window (see the module docstring): the
# group sum of the window's softmax rows [H_kv], and, for policies that need it, per query head [H_kv, G].
WINDOW_MASS = "wmass"
WINDOW_MASS_HEADS = "wmass_heads"
WINDOW_STATES = (WINDOW_MASS, WINDOW_MASS_HEADS)


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
    lengths: Tensor  # int64 [R]: candidates per row; slots at or beyond are padding
    queries: Tensor
    query_positions: Tensor
    scale: float
    seq_len: Tensor  # int64 [R]: logical tokens seen so far, this step's included
    num_new: Tensor  # int64 [R]: candidates added this step (each row's last ``num_new`` slots)
    phase: Phase = Phase.PREFILL
    state: dict[str, Tensor] = field(default_factory=dict)
    layer: int = 0
    seed: Tensor | int = 0  # per-row seed; policies derive per-(layer, head) streams from it
    head_offset: int = 0  # global index of KV head 0 here (tensor parallel: the rank's first head)
    # Ranks holding a copy of each KV head (tensor parallel over more ranks than KV heads): each copy
    # has 1/kv_replicas of the group's query heads in ``queries``, and ``ops`` completes the group sums.
    kv_replicas: int = 1
    kv_heads_total: int = 0  # KV heads of the whole layer over every rank (0: those here are all of them)
    o_proj: Tensor | None = None  # [hidden, H_q * d] output projection, for policies that need it
    budget: Tensor | None = None  # int64 [R]: tokens each row keeps per head this step (None: no eviction)
    budget_max: int = 0  # the largest budget, known on the host so that shapes need no device sync
    max_seq_len: int = 0  # the largest seq_len, on the host (0: unknown; ``seq_len_bound`` refuses to guess)
    ops: ScoreOps = DENSE  # where the heavy score arithmetic runs (the engine's reads its pages)
    # int64 [R]: queries in the window the engine accumulated into state WINDOW_MASS (None: the window's
    # queries are ``queries`` and its mass is computed from them).
    window_count: Tensor | None = None
    # Numeric options whose value differs between the rows of a batched call, per row [R] (int64, or
    # float64 for a float option): the engine batches requests of one method whatever their options
    # (``Policy.option`` reads them); an option not here has the policy's own value in every row.
    row_options: dict[str, Tensor] = field(default_factory=dict)
    row_option_bounds: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # their (min, max), on the host

    # Shapes come from ``positions``, which is always a tensor, so asking them loads nothing.
    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.positions.shape[1]

    @property
    def width(self) -> int:
        """N: the padded candidate axis."""
        return self.positions.shape[2]

    @property
    def group_size(self) -> int:
        """G: query heads per KV head in the model (not only those in ``queries`` on this rank)."""
        return self.queries.shape[1] * self.kv_replicas // self.num_kv_heads

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def layer_query_heads(self) -> int:
        """Query heads of the whole layer (every tensor-parallel rank's)."""
        return (self.kv_heads_total or self.num_kv_heads) * self.group_size

    @property
    def valid(self) -> Tensor:
        """Bool [R, 1, N]: slots that hold a candidate."""
        return dense.valid_slots(self.lengths, self.width)

    @property
    def evicting(self) -> bool:
        return self.budget is not None

    def evolve(self, **changes: Any) -> "EvictionInputs":
        """A copy with some fields changed; unlike ``dataclasses.replace`` it loads nothing deferred."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    def with_state(self, state: dict[str, Tensor]) -> "EvictionInputs":
        return self.evolve(state=state)

    @property
    def seq_len_bound(self) -> int:
        """A host int above every logical position in the batch: ``max_seq_len``, which the caller knows on
        the host (reading it from ``seq_len`` would make the host wait for the device)."""
        if self.num_rows and self.max_seq_len <= 0:
            raise ValueError("EvictionInputs.max_seq_len must be set (the largest seq_len, a host int) for a "
                             "policy that needs a bound on the positions; it is not read from seq_len, which "
                             "would make the host wait for the device")
        return self.max_seq_len if self.num_rows else 0

    def latest_query_positions(self, count: Tensor | int) -> Tensor:
        """The query positions with all but each row's ``count`` most recent queries emptied."""
        return dense.latest_queries(self.query_positions, self.seq_len, count)

    def window_mass(self, count: Tensor | int | None = None, gain: Tensor | float | None = None,
                    per_query_head: bool = False) -> Tensor:
        """Attention mass of the observation window: the sum over its queries of their softmax rows over
        the candidates, fp32 [R, H_kv, N] (GQA group sum) or [R, H_kv, G, N] (``per_query_head``).

        ``count`` (per row or one int; None: every window query) keeps each row's most recent queries,
        ``gain`` multiplies their logits (AhaKV). When the engine accumulated the window as its queries
        arrived (``window_count`` set), the policy's ``window_size``/``window_gain`` already chose the
        same queries and gain, and the state is returned."""
        if self.window_count is not None:
            if per_query_head:
                return self.state[WINDOW_MASS_HEADS].permute(0, 1, 3, 2).masked_fill(~self.valid.unsqueeze(2), 0.0)
            return self.state[WINDOW_MASS].masked_fill(~self.valid, 0.0)
        positions = self.query_positions if count is None else self.latest_query_positions(count)
        return self.ops.window_mass(self, query_positions=positions, gain=gain, per_query_head=per_query_head)

    def window_queries(self) -> Tensor:
        """Queries in each row's observation window, int64 [R]."""
        if self.window_count is not None:
            return self.window_count
        return (self.query_positions >= 0).sum(dim=-1)

    def zeros(self) -> Tensor:
        """fp32 [R, H, N] zeros."""
        return torch.zeros(self.positions.shape, dtype=torch.float32, device=self.device)


@dataclass
class StepResult:
    state: dict[str, Tensor]  # full state over the candidates (before compaction), [R, H, N]
    keep: Tensor | None = None  # [R, H, budget_max] kept slots, ascending in each row's first budget[r]


class Policy(ABC):
    """Base class. Subclasses set the class variables and implement ``scores``.

    ``scores`` returns fp32 [R, H_kv, N]: higher means keep; +inf marks protected tokens.
    The default ``select`` keeps each row's ``budget`` highest scores per head, ties going to the
    lower slot.
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
    # The states ``init_state`` computes from a token's key/value (the others start at 0).
    computed_state: ClassVar[tuple[str, ...]] = ()
    # Option sets under which the method keeps per-token states its defaults do not (e.g. a per-query-head
    # window mass): a server reserving the method for requests reserves these too (vllm_evict.reservation).
    state_variants: ClassVar[tuple[dict[str, Any], ...]] = ()
    # True when ``update_state`` must run on every step, not only when evicting.
    needs_every_step: ClassVar[bool] = False
    needs_o_proj: ClassVar[bool] = False
    # Options are typed class attributes with their defaults (``window: int = 32``); ``defaults``, the
    # option name -> default, is collected from them (base classes first) and is what ``from_spec``
    # validates user options against. An instance holds its values as attributes of the same names.
    defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        options: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            for name, hint in vars(klass).get("__annotations__", {}).items():
                if "ClassVar" not in str(hint) and name in vars(klass):
                    options[name] = vars(klass)[name]
        cls.defaults = options

    def __init__(self, **options: Any) -> None:
        self.options = {**self.defaults, **options}
        for key, value in self.options.items():
            setattr(self, key, value)

    # ---- options that may differ between the rows of one call ------------------------------------
    def all_options(self) -> dict[str, Any]:
        """Every option of this policy by name (a meta score's and its base's)."""
        return dict(self.options)

    def row_option_names(self) -> tuple[str, ...]:
        """Options that may differ between the rows of one batched call (``EvictionInputs.row_options``):
        the numeric ones (windows, sinks, kernels, ratios, ...; budgets and seeds are per row anyway).
        The others (choices such as pooling or CAOTE's mode) change what the call computes, so the rows
        of a call share them, and so do their numeric options set to None (an automatic rule)."""
        return _numeric_options(type(self))

    def option(self, inp: EvictionInputs, name: str) -> Any:
        """Option ``name`` for the rows of ``inp``: the policy's own value, or per row ([R] tensor, int64 or
        float64) when the rows have different values."""
        per_row = inp.row_options.get(name)
        return getattr(self, name) if per_row is None else per_row

    def option_max(self, inp: EvictionInputs, name: str) -> Any:
        """The largest value of option ``name`` over the rows of ``inp``, on the host."""
        bounds = inp.row_option_bounds.get(name)
        return getattr(self, name) if bounds is None else bounds[1]

    def option_min(self, inp: EvictionInputs, name: str) -> Any:
        """The smallest value of option ``name`` over the rows of ``inp``, on the host."""
        bounds = inp.row_option_bounds.get(name)
        return getattr(self, name) if bounds is None else bounds[0]

    # ---- what the engine needs to know -------------------------------------------------
    @property
    def query_window(self) -> int | None:
        """How many of the most recent queries the policy reads.

        An int w: the last w queries of the request (the engine keeps a ring buffer across steps).
        ``None``: exactly the queries of the current step (H2O accumulates all of them).
        0: no queries at all.
        """
        return 0

    def window_for(self, budget: int | None) -> int:
        """The widest observation window of a request keeping ``budget`` tokens (None: any budget):
        ``query_window`` unless the policy reads fewer at that budget. Checked against the server's
        ``max_window``; sizes the query ring of elastic servers."""
        return self.query_window or 0

    # ---- the observation window, as the engine accumulates it --------------------------------
    # Whether the policy reads its window at the end of the prompt even when nothing is evicted there
    # (AhaKV seeds its decode score from it), and whether decode evictions read it.
    window_at_prompt_end: ClassVar[bool] = False
    window_in_decode: ClassVar[bool] = True

    @property
    def accumulates_window(self) -> bool:
        """The policy has an observation window (``query_window`` a positive int): the engine keeps
        its mass in state WINDOW_MASS."""
        window = self.query_window
        return window is not None and window > 0

    @property
    def needs_window_heads(self) -> bool:
        """The policy reads its window mass per query head (state WINDOW_MASS_HEADS, G values a token)."""
        return False

    @property
    def head_state_names(self) -> tuple[str, ...]:
        """Per-token states with a trailing query-head axis [.., G]."""
        return (WINDOW_MASS_HEADS,) if self.needs_window_heads else ()

    def window_size(self, seq_len: np.ndarray, budget: np.ndarray) -> np.ndarray:
        """Queries in the window of an eviction that happens at logical length ``seq_len`` keeping
        ``budget`` tokens (at a prompt end that evicts nothing: the cache length), per row, on the host.
        The engine accumulates exactly the last that many queries before the eviction."""
        return np.full(len(seq_len), self.query_window or 0, dtype=np.int64)

    def window_gain(self, seq_len: np.ndarray, budget: np.ndarray, head_size: int) -> np.ndarray | None:
        """The logit gain of the window's softmax rows per row (None: 1), for the same eviction
        (``head_size``: the attention's d, for gains defined on the raw q.k)."""
        return None

    def protected_count(self, budget: int) -> int:
        """Tokens this policy always keeps; ``from_spec`` checks it fits in the budget."""
        return 0

    def cap_query_window(self, limit: int) -> None:
        """Bound a window the policy sizes by itself (NaCl's automatic proxy count) by ``limit`` queries,
        the engine's ``max_window``. Windows set by an option are checked against it, never capped."""

    def check_options(self) -> None:
        """Raise ValueError (see ``options.py``) for option values this policy cannot work with."""

    def validate(self, budget: int) -> None:
        """Raise ValueError for options that do not fit this ``budget`` (beyond ``protected_count``)."""

    # ---- per-token state -----------------------------------------------------------------
    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   ops: ScoreOps = DENSE) -> dict[str, Tensor]:
        """The ``computed_state`` of tokens entering the cache: K/V [H_kv, T, d] (any rows' tokens) ->
        {name: [H_kv, T]}; every other state starts at 0.

        A pure function of each token's own key, value and the weights, so the engine computes it for
        a whole step's tokens at once."""
        return {}

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        """Per-step state update over all candidates (e.g. H2O accumulation). Default: unchanged."""
        return inp.state

    # ---- scoring and selection -----------------------------------------------------------
    def attention_mass(self, inp: EvictionInputs) -> Tensor:
        """Finite, non-negative attention-like mass [R, H_kv, N] (only for ``is_attention_mass`` policies)."""
        raise NotImplementedError(f"{self.name} has no attention-mass score")

    def mass_rows(self, inp: EvictionInputs) -> Tensor:
        """How many softmax rows ``attention_mass`` adds up, per row [R] (each row sums to 1 per query
        head and is averaged over the group): CriticalKV divides by it to get a mean attention."""
        raise NotImplementedError(f"{self.name} has no attention-mass score")

    def ranking_mass(self, inp: EvictionInputs) -> Tensor:
        """The attention mass this policy ranks its unprotected tokens by: its ``scores`` before protection,
        [R, H_kv, N].

        CriticalKV's stage 1 reads this; CAOTE reads ``attention_mass``. They differ where the method's
        own ranking is not the per-KV-head output weight CAOTE needs (SnapKV, TOVA); default: the same.
        """
        return self.attention_mass(inp)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        """Bool [R, H_kv, N]: tokens that are always kept. Default: none."""
        return torch.zeros(inp.positions.shape, dtype=torch.bool, device=inp.device)

    @abstractmethod
    def scores(self, inp: EvictionInputs) -> Tensor:
        """fp32 [R, H_kv, N]; higher is kept; +inf for protected tokens."""

    def select(self, inp: EvictionInputs) -> Tensor:
        """Kept slots [R, H_kv, budget_max] (see ``dense.topk_keep``) for ``inp.budget``."""
        return dense.topk_keep(self.scores(inp), inp.valid, inp.budget, inp.budget_max)

    def step(self, inp: EvictionInputs) -> StepResult:
        """One step for one layer: update state, and if ``inp.budget`` is set, choose the survivors."""
        state = self.update_state(inp) if (self.needs_every_step or inp.evicting) else inp.state
        if not inp.evicting:
            return StepResult(state=state, keep=None)
        return StepResult(state=state, keep=self.select(inp.with_state(state)))


@functools.lru_cache(maxsize=None)
def _numeric_options(cls: type) -> tuple[str, ...]:
    """The numeric options of a policy class (asked on every step: computed once per class)."""
    return tuple(name for name, default in cls.defaults.items() if _numeric_option(cls, name, default))


def _numeric_option(cls: type, name: str, default: Any) -> bool:
    """An option whose type (its annotation, or its default's) is int or float, bools excluded."""
    for klass in cls.__mro__:
        hint = vars(klass).get("__annotations__", {}).get(name)
        if hint is not None:
            return str(hint).replace(" ", "") in ("int", "float", "int|None", "float|None")
    return isinstance(default, (int, float)) and not isinstance(default, bool)


def per_row(value: Any, ndim: int = 3, dtype: torch.dtype | None = None) -> Any:
    """An option value as it broadcasts against [R, ...] tensors of ``ndim`` dims: a per-row [R] tensor
    viewed as [R, 1, ...] (in ``dtype``), a plain number unchanged."""
    if not isinstance(value, Tensor):
        return value
    view = value.view(-1, *([1] * (ndim - 1)))
    return view if dtype is None else view.to(dtype)


class SinksAndRecent(Policy):
    """A policy whose only protected tokens are the optional first ``sinks`` and last ``recent``
    logical positions (both off by default, as in the papers' harness)."""

    recent: int = 0  # the newest logical positions always kept
    sinks: int = 0  # the first logical positions always kept

    def check_options(self) -> None:
        from vllm_evict.policies.options import check_int

        check_int("recent", self.recent)
        check_int("sinks", self.sinks)

    def protected_count(self, budget: int) -> int:
        return self.sinks + self.recent

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        valid = inp.valid
        return (dense.recent_mask(inp.positions, valid, self.option(inp, "recent"))
                | dense.sink_mask(inp.positions, valid, self.option(inp, "sinks")))


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
        self.computed_state = tuple(dict.fromkeys(base.computed_state + type(self).computed_state))

    @classmethod
    def accepts(cls, base_cls: type[Policy]) -> bool:
        return bool(base_cls.is_attention_mass)

    def all_options(self) -> dict[str, Any]:
        return {**self.base.all_options(), **self.options}

    def row_option_names(self) -> tuple[str, ...]:
        return (*self.base.row_option_names(), *super().row_option_names())

    @property
    def query_window(self) -> int | None:
        return self.base.query_window

    def window_for(self, budget: int | None) -> int:
        return self.base.window_for(budget)

    @property
    def window_at_prompt_end(self) -> bool:  # type: ignore[override]
        return self.base.window_at_prompt_end

    @property
    def window_in_decode(self) -> bool:  # type: ignore[override]
        return self.base.window_in_decode

    @property
    def needs_window_heads(self) -> bool:
        return self.base.needs_window_heads

    def window_size(self, seq_len: np.ndarray, budget: np.ndarray) -> np.ndarray:
        return self.base.window_size(seq_len, budget)

    def window_gain(self, seq_len: np.ndarray, budget: np.ndarray, head_size: int) -> np.ndarray | None:
        return self.base.window_gain(seq_len, budget, head_size)

    def protected_count(self, budget: int) -> int:
        return self.base.protected_count(budget)

    def cap_query_window(self, limit: int) -> None:
        self.base.cap_query_window(limit)

    def validate(self, budget: int) -> None:
        self.base.validate(budget)

    def init_state(self, new_keys: Tensor, new_values: Tensor, o_proj: Tensor | None,
                   ops: ScoreOps = DENSE) -> dict[str, Tensor]:
        return self.base.init_state(new_keys, new_values, o_proj, ops)

    def update_state(self, inp: EvictionInputs) -> dict[str, Tensor]:
        return self.base.update_state(inp)

    def protected_mask(self, inp: EvictionInputs) -> Tensor:
        return self.base.protected_mask(inp)
