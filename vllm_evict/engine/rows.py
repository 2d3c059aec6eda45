"""Per-row eviction state of the model runner's input batch, kept in step with vLLM's own row moves.

vLLM keeps every request of the running batch in a row of its ``InputBatch`` and moves rows around
(``condense`` after requests finish, ``swap_states`` when it reorders). It also takes a running request
out of the batch for a step in which it is not scheduled, and puts it back (in any row) later. The
eviction step needs a few numbers per row on every step (tokens evicted so far, which policy, where the
request's recent queries are), so they live in persistent arrays indexed like vLLM's and follow the
same moves: hooks on ``InputBatch.add_request`` / ``remove_request`` and on the block table's
``move_row`` / ``swap_row`` / ``clear_row``, which every row move in vLLM goes through. A request that
leaves the batch without finishing is parked and gets its numbers back when it returns. Nothing is
rebuilt from Python lists per step.

That is the V1 runner. Model Runner V2 keeps each request in a fixed slot of its ``RequestState`` from
arrival to finish, so there the rows are those slots, filled and emptied by engine/runner_v2.py's
hooks on ``add_requests`` / ``_remove_request``; ``install_row_hooks`` and parking are V1's only.

Each request also owns a slot from its first step to its end (finish or preemption): its slot of the
query ring of elastic servers (engine/buffers.py), and the pages the scheduler lends it for its decode
window's queries (engine/window_pages.py), so neither moves, whatever happens to its row.

A request's eviction config is the canonical form the scheduler accepted (``vllm_evict.request_settings``):
the worker never parses a request's JSON. The policy table holds one entry per distinct config of the
requests held here, and forgets an entry when its last request ends, so its size is bounded by the
requests the worker holds, however many distinct configs (seeds, budgets) clients send. Entries that
differ only in numbers (seeds, budgets, windows, sinks, kernels, ratios, ...) share a *group*: a step
scores their rows in one call, each row with its own numbers (``PolicyTable.group``), so the work per
layer follows the methods in use, not the configs.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from vllm_evict.config import EvictionConfig
from vllm_evict.engine.window_pages import NO_PAGE
from vllm_evict.policies.base import Policy
from vllm_evict.request_settings import config_of_extra_args, server_settings


class PolicyTable:
    """The distinct eviction configs of the requests held now, each with its one policy instance.

    Indices are what the row arrays hold. Each entry counts its users (``acquire`` / ``release``); an entry
    without users is forgotten and its index goes to the next new config, so the table never holds more
    entries than requests held at once (plus pinned ones, the server's own config). ``version`` changes
    whenever an index gets a config, so that anything cached per index knows to rebuild.
    ``window_cap``: the server's max_window, bounding the windows policies size by themselves."""

    def __init__(self, window_cap: int | None = None) -> None:
        self.configs: list[EvictionConfig] = []
        self.policies: list[Policy] = []
        self.users: list[int] = []
        self.window_cap = window_cap
        self.version = 0
        self._index: dict[str, int] = {}
        self._free: list[int] = []
        # Per entry: its group (the entries a step scores together), its seed, and its numeric options
        # and query window as float64 (exact: they are integers below 2^31 or floats).
        self.group = np.zeros(0, dtype=np.int64)
        self.seed = np.zeros(0, dtype=np.int64)
        self.numbers: dict[str, np.ndarray] = {}
        self._groups: dict[tuple, int] = {}  # group key -> id (a fixed set: methods x choice options)

    def acquire(self, config: EvictionConfig) -> tuple[int, bool]:
        """The index of ``config``, counted as one more user; True when the entry is new."""
        key = str(config)
        index = self._index.get(key)
        new = index is None
        if index is None:
            policy = config.build_policy(window_cap=self.window_cap)
            if self._free:
                index = self._free.pop()
                self.configs[index], self.policies[index], self.users[index] = config, policy, 0
            else:
                index = len(self.configs)
                self.configs.append(config)
                self.policies.append(policy)
                self.users.append(0)
                self._grow(index + 1)
            self._describe(index, config, policy)
            self._index[key] = index
            self.version += 1
        self.users[index] += 1
        return index, new

    def _grow(self, size: int) -> None:
        if size <= len(self.group):
            return
        size = max(size, 2 * len(self.group))
        self.group = np.resize(self.group, size)
        self.seed = np.resize(self.seed, size)
        self.numbers = {name: np.resize(values, size) for name, values in self.numbers.items()}

    def _describe(self, index: int, config: EvictionConfig, policy: Policy) -> None:
        """Entry ``index``'s group and numbers (``group_key`` says which configs share a group)."""
        key = group_key(config, policy)
        self.group[index] = self._groups.setdefault(key, len(self._groups))
        self.seed[index] = config.seed
        options = policy.all_options()
        numbers = {name: options[name] for name in policy.row_option_names() if options[name] is not None}
        numbers["query_window"] = policy.query_window or 0
        for name, value in numbers.items():
            if name not in self.numbers:
                self.numbers[name] = np.zeros(len(self.group), dtype=np.float64)
            self.numbers[name][index] = value

    def release(self, index: int) -> None:
        """One user of ``index`` is gone; the entry is forgotten with its last user."""
        self.users[index] -= 1
        if self.users[index] == 0:
            del self._index[str(self.configs[index])]
            self._free.append(index)

    def index_of(self, config: EvictionConfig) -> int:
        """The index of a config used for the table's whole life (the server's own): never released."""
        return self.acquire(config)[0]

    def live(self) -> int:
        """Entries some request (or the server) uses."""
        return len(self._index)

    def __len__(self) -> int:
        return len(self.configs)


def group_key(config: EvictionConfig, policy: Policy) -> tuple:
    """What the configs one call can score together share: the method, the mode, every option that is
    not a number (choices such as pooling), and which numeric options are left to their automatic rule
    (None). Seeds, budgets and the numeric options differ per row."""
    numeric = set(policy.row_option_names())
    options = policy.all_options()
    fixed = tuple(sorted((name, repr(value)) for name, value in options.items()
                         if name not in numeric or value is None))
    return config.policy, config.mode, fixed


class RowTable:
    """Host arrays over the input batch's rows (``max_rows`` of them), and the ring slots."""

    FIELDS = ("evicted", "cached", "policy", "slot", "window")

    def __init__(self, max_rows: int, server: dict[str, Any] | None, policies: PolicyTable,
                 on_new_policy: Callable[[EvictionConfig, Policy], None] | None = None,
                 on_new_slot: Callable[[int], None] | None = None) -> None:
        settings = server_settings(server)  # the server's kv_eviction mapping, parsed once
        self.server = settings[0].eviction if settings is not None else None
        self.policies = policies
        if settings is not None and policies.window_cap is None:
            policies.window_cap = settings[1].max_window
        self.on_new_policy = on_new_policy
        self.on_new_slot = on_new_slot
        self.evicted = np.zeros(max_rows, dtype=np.int64)  # logical - physical tokens before the step
        self.cached = np.zeros(max_rows, dtype=np.int64)  # physical tokens after the last step
        self.policy = np.full(max_rows, -1, dtype=np.int64)  # index into ``policies``; -1: eviction off
        self.slot = np.full(max_rows, -1, dtype=np.int64)  # the request's ring slot
        # queries in the request's accumulated observation window (fixed mode, vllm_evict.schedule.window_end)
        self.window = np.zeros(max_rows, dtype=np.int64)
        self.parked: dict[str, tuple[int, ...]] = {}  # out of the batch for a while, not finished
        self.slot_of: dict[str, int] = {}
        self.policy_of: dict[str, int] = {}  # request id -> its entry in ``policies`` (released when forgotten)
        self.free_slots = list(range(max_rows - 1, -1, -1))
        self.forgotten: set[str] = set()  # finished or preempted in the step being set up
        # Per slot: the pages lent for the request's decode window (NO_PAGE: none; sized by
        # ``size_window_pages``) and the window's queries waiting in them.
        self.window_pages = np.full((max_rows, 0), NO_PAGE, dtype=np.int64)
        self.window_queued = np.zeros(max_rows, dtype=np.int64)

    def size_window_pages(self, pages: int) -> None:
        """The most pages a loan can have (the widest window the server allows)."""
        self.window_pages = np.full((len(self.window_queued), pages), NO_PAGE, dtype=np.int64)

    def lend_window_pages(self, request_id: str, pages: list[int]) -> None:
        slot = self.slot_of.get(request_id)
        if slot is None:
            return  # gone before the loan reached this worker (its pages are back in the pool already)
        if len(pages) > self.window_pages.shape[1]:
            raise RuntimeError(f"vllm_evict: request {request_id} was lent {len(pages)} window pages, more than "
                               f"the {self.window_pages.shape[1]} its server's max_window needs")
        self.window_pages[slot] = NO_PAGE
        self.window_pages[slot, :len(pages)] = pages
        self.window_queued[slot] = 0

    def end_window_loan(self, slot: int) -> None:
        self.window_pages[slot] = NO_PAGE
        self.window_queued[slot] = 0

    def _values(self, row: int) -> tuple[int, ...]:
        return tuple(int(getattr(self, f)[row]) for f in self.FIELDS)

    def _set(self, row: int, values: tuple[int, ...]) -> None:
        for name, value in zip(self.FIELDS, values):
            getattr(self, name)[row] = value

    def add(self, row: int, request: Any) -> None:
        """A request enters ``row``: new, back after a step out of the batch, or resumed after
        preemption (then it was forgotten, and is recomputed from scratch)."""
        request_id = request.req_id
        if request_id in self.parked:
            self._set(row, self.parked.pop(request_id))
            return
        params = getattr(request, "sampling_params", None)
        config = config_of_extra_args(self.server, params.extra_args if params is not None else None)
        held = self.policy_of.pop(request_id, None)
        if held is not None:
            self.policies.release(held)
        policy = -1
        if config is not None:
            policy, new = self.policies.acquire(config)
            self.policy_of[request_id] = policy
            if new and self.on_new_policy is not None:
                self.on_new_policy(config, self.policies.policies[policy])
        slot = self.slot_of.get(request_id)
        if slot is None:
            slot = self.slot_of[request_id] = self.free_slots.pop()
            self.end_window_loan(slot)
            if self.on_new_slot is not None:
                self.on_new_slot(slot)
        self._set(row, (0, 0, policy, slot, 0))

    def park(self, request_id: str, row: int) -> None:
        """The request leaves the batch (before vLLM clears its row)."""
        if request_id not in self.forgotten:
            self.parked[request_id] = self._values(row)

    def forget(self, request_id: str) -> None:
        """The request finished, was aborted or was preempted: nothing of it is kept."""
        self.parked.pop(request_id, None)
        policy = self.policy_of.pop(request_id, None)
        if policy is not None:
            self.policies.release(policy)
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.end_window_loan(slot)  # the scheduler has taken its pages back
            self.free_slots.append(slot)
        self.forgotten.add(request_id)

    def clear(self, row: int) -> None:
        self._set(row, (0, 0, -1, -1, 0))

    def move(self, src: int, tgt: int) -> None:
        self._set(tgt, self._values(src))
        self.clear(src)

    def swap(self, a: int, b: int) -> None:
        values_a = self._values(a)
        self._set(a, self._values(b))
        self._set(b, values_a)

    def held_requests(self) -> set[str]:
        """Requests this table holds anything for (out of the batch or in it)."""
        return set(self.parked) | set(self.slot_of) | set(self.policy_of)


def install_row_hooks(input_batch: Any, rows: RowTable) -> None:
    """Make ``input_batch`` report row additions, removals and moves to ``rows`` (class swap of the
    instances; idempotent)."""
    input_batch.evict_rows = rows
    block_table = input_batch.block_table
    block_table.evict_rows = rows
    if not getattr(type(input_batch), "_evict_hooked", False):
        input_batch.__class__ = _hooked(type(input_batch), _InputBatchHooks)
    if not getattr(type(block_table), "_evict_hooked", False):
        block_table.__class__ = _hooked(type(block_table), _BlockTableHooks)


_HOOKED: dict[tuple[type, type], type] = {}


def _hooked(base: type, hooks: type) -> type:
    key = (base, hooks)
    if key not in _HOOKED:
        _HOOKED[key] = type(base.__name__, (hooks, base), {"_evict_hooked": True, "__module__": base.__module__})
    return _HOOKED[key]


class _InputBatchHooks:
    evict_rows: RowTable

    def add_request(self, request: Any) -> int:
        row = super().add_request(request)  # type: ignore[misc]
        self.evict_rows.add(row, request)
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_index.get(req_id)  # type: ignore[attr-defined]
        if row is not None:
            self.evict_rows.park(req_id, row)
        return super().remove_request(req_id)  # type: ignore[misc]


class _BlockTableHooks:
    evict_rows: RowTable

    def clear_row(self, row: int) -> None:
        super().clear_row(row)  # type: ignore[misc]
        self.evict_rows.clear(row)

    def move_row(self, src: int, tgt: int) -> None:
        super().move_row(src, tgt)  # type: ignore[misc]
        self.evict_rows.move(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        super().swap_row(src, tgt)  # type: ignore[misc]
        self.evict_rows.swap(src, tgt)
