"""Per-row eviction state of the model runner's input batch, kept in step with vLLM's own row moves.

vLLM keeps every request of the running batch in a row of its ``InputBatch`` and moves rows around
(``condense`` after requests finish, ``swap_states`` when it reorders). The eviction step needs a
few numbers per row on every step (tokens evicted so far, which policy), so they live in persistent
arrays indexed like vLLM's and follow the same moves: hooks on ``InputBatch.add_request`` and on the
block table's ``move_row`` / ``swap_row``, which every row move in vLLM goes through. Nothing is
rebuilt from Python lists per step.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from vllm_evict.config import EvictionConfig, resolve_request_config
from vllm_evict.policies.base import Policy


class PolicyTable:
    """The distinct eviction configs of the requests seen so far, each with its one policy instance."""

    def __init__(self) -> None:
        self.configs: list[EvictionConfig] = []
        self.policies: list[Policy] = []
        self._index: dict[str, int] = {}

    def index_of(self, config: EvictionConfig) -> int:
        key = str(config)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.configs)
            self.configs.append(config)
            self.policies.append(config.build_policy())
        return index

    def __len__(self) -> int:
        return len(self.configs)


class RowTable:
    """Host arrays over the input batch's rows (``max_rows`` of them)."""

    def __init__(self, max_rows: int, server: dict[str, Any] | None, policies: PolicyTable,
                 on_new_policy: Callable[[Policy], None] | None = None) -> None:
        self.server = server
        self.policies = policies
        self.on_new_policy = on_new_policy
        self.evicted = np.zeros(max_rows, dtype=np.int64)  # logical - physical tokens before the step
        self.cached = np.zeros(max_rows, dtype=np.int64)  # physical tokens after the last step
        self.policy = np.full(max_rows, -1, dtype=np.int64)  # index into ``policies``; -1: eviction off
        self.listeners: list[Callable[[str, int, int], None]] = []  # (kind, a, b) after each move

    def add(self, row: int, request: Any) -> None:
        """A request (new, or resumed after preemption: recomputed from scratch) enters ``row``."""
        params = getattr(request, "sampling_params", None)
        config = resolve_request_config(self.server, params.extra_args if params is not None else None)
        known = len(self.policies)
        self.policy[row] = -1 if config is None else self.policies.index_of(config)
        if len(self.policies) > known and self.on_new_policy is not None:
            self.on_new_policy(self.policies.policies[-1])
        self.evicted[row] = 0
        self.cached[row] = 0
        for listener in self.listeners:
            listener("add", row, row)

    def clear(self, row: int) -> None:
        """The row's request left the batch (finished, aborted or preempted)."""
        self.evicted[row] = self.cached[row] = 0
        self.policy[row] = -1

    def move(self, src: int, tgt: int) -> None:
        for array in (self.evicted, self.cached, self.policy):
            array[tgt] = array[src]
        self.clear(src)
        for listener in self.listeners:
            listener("move", src, tgt)

    def swap(self, a: int, b: int) -> None:
        for array in (self.evicted, self.cached, self.policy):
            array[[a, b]] = array[[b, a]]
        for listener in self.listeners:
            listener("swap", a, b)


def install_row_hooks(input_batch: Any, rows: RowTable) -> None:
    """Make ``input_batch`` report row additions and moves to ``rows`` (class swap of the instances;
    idempotent)."""
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
