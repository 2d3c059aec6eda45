"""Once per step, before the forward: physical lengths for attention, and the ``StepPlan`` every
layer's hook runs (``vllm_evict.evict_step``).

Everything here is per step, not per layer, and vectorised over the batch's rows with numpy on the
host (vLLM's own per-row arrays, and ours in engine/rows.py); device work is a handful of copies and
index computations, none of which waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_evict.engine.buffers import EvictionBuffers
from vllm_evict.engine.plan import EvictionPlan
from vllm_evict.engine.rows import RowTable
from vllm_evict.engine.runner_view import RunnerView
from vllm_evict.engine.window_pages import NO_PAGE
from vllm_evict.engine.window_pages import capacity as window_capacity
from vllm_evict.engine.window_pages import SlotRows, write_rows, write_table
from vllm_evict.evict_step import (
    Group, Record, StepPlan, WindowStep, WindowWrites, accumulate_window, add_window_mass, build_group, evict_layer,
    fuses_window, group_inputs, page_window, record_step, ring_entries, state_initializers,
)
from vllm_evict.policies.base import Phase, Policy
from vllm_evict.schedule import window_end
from vllm_evict.staging import Staging

PHASES = (Phase.PREFILL, Phase.PROMPT_END, Phase.DECODE)


@dataclass
class Compaction:
    """A request compacted in this step: applied to vLLM's block table at the start of the next."""

    request_id: str
    logical: int  # logical tokens after this step
    keep: int  # tokens left in cache


@dataclass
class RowWindows:
    """Per row of a step (see ``StepBuilder._windows``)."""

    recorded: np.ndarray  # this step's queries that join the window
    count: np.ndarray  # the window's queries after them
    gain: np.ndarray  # the window's logit gain (NaN: none)
    reset: bool | np.ndarray  # the step reads the window
    ring: np.ndarray  # elastic rows: their queries go to the ring, their policy reads them there
    # Fixed-mode rows with lent window pages (engine/window_pages.py): their window's queries wait there
    # and its mass is computed when the window is read; ``lent`` [rows, P] (NO_PAGE: none), ``queued``
    # the window's queries waiting there after this step's, ``capacity`` the entries the pages hold.
    lent: np.ndarray
    queued: np.ndarray
    capacity: np.ndarray
    group: int

    @property
    def deferred(self) -> np.ndarray:
        return self.lent[:, 0] != NO_PAGE if self.lent.shape[1] else np.zeros(len(self.recorded), dtype=bool)

    @property
    def to_pages(self) -> np.ndarray:
        """Rows whose queries of this step go to their lent pages."""
        return self.deferred & (self.recorded > 0)

    @property
    def adds_mass(self) -> np.ndarray:
        """Rows whose window mass grows in this step (their window's queries accumulated as they arrive)."""
        return (self.recorded > 0) & ~self.deferred

    def step(self, rows: np.ndarray, policy: Policy) -> WindowStep | None:
        """The ``WindowStep`` of a group's rows (None: they keep no accumulated window)."""
        if not policy.accumulates_window or self.ring[rows[0]]:
            return None
        gain = self.gain[rows]
        deferred = self.deferred[rows]
        return WindowStep(recorded=self.recorded[rows], count=self.count[rows],
                          gain=None if np.isnan(gain).all() else gain, reset=bool(self.reset[rows[0]]),
                          lent=self.lent[rows] if deferred.any() else None,
                          queued=np.where(deferred, self.queued[rows], 0), capacity=self.capacity[rows],
                          group=self.group)


@dataclass
class BuiltStep:
    plan: StepPlan
    initializers: list[Policy]
    num_tokens: int
    compactions: list[Compaction]
    rows: dict[str, int]  # request id -> row, for the requests of a group (records, tests)
    # Prefix caching: request id -> its page list from the next step on (this step's copies in place).
    relocations: dict[str, list[int]] = field(default_factory=dict)

    @property
    def layer_work(self) -> bool:
        """Whether the per-layer hook has anything to do (queries to record, states to compute, rows to
        look at); most decode steps far from any eviction have none."""
        record = self.plan.record
        return (record.ring_index is not None or record.window_writes is not None or bool(self.initializers)
                or bool(self.plan.groups) or self.plan.copies is not None)


def phase_codes(computed: np.ndarray, scheduled: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """Index into PHASES per row, as ``vllm_evict.schedule.phase_of`` decides it."""
    return np.where(computed >= prompt, 2, np.where(computed + scheduled >= prompt, 1, 0))


class StepBuilder:
    def __init__(self, rows: RowTable, buffers: EvictionBuffers, device: torch.device) -> None:
        self.rows = rows
        self.buffers = buffers
        self.device = device
        self.page_size = buffers.geometry.page_size
        # Persistent per-row buffer of evicted counts on the device, refilled (not reallocated) per step.
        self.evicted_device = torch.zeros(len(rows.evicted), dtype=torch.int64, device=device)
        self.staging = Staging(device)  # pinned host memory for the step's host-to-device copies
        # Where the layers' window slots are rows of their KV storage (set with the layers; None: not).
        self.slot_rows: SlotRows | None = None

    # ---- physical lengths ------------------------------------------------------------------------
    def make_lengths_physical(self, view: RunnerView, num_reqs: int, num_tokens: int) -> None:
        """Attention reads each row's compacted cache and writes new tokens right after it: subtract the
        row's evicted count from the lengths attention sees and from the slot positions (RoPE positions
        stay logical; the runner's view knows where its lengths are)."""
        evicted = self.rows.evicted[view.rows]
        if not evicted.any():
            return
        shift = self.evicted_device[:num_reqs]
        self.staging.copy_into(shift, evicted)
        view.make_lengths_physical(evicted, shift, num_tokens, self.staging.to_device)

    # ---- the step plan -------------------------------------------------------------------------
    def build(self, view: RunnerView, plan: EvictionPlan, num_scheduled: np.ndarray) -> BuiltStep | None:
        num_reqs = view.num_reqs
        table_rows = view.rows
        num_tokens = int(num_scheduled[:num_reqs].sum())
        self.make_lengths_physical(view, num_reqs, num_tokens)

        computed = view.computed
        scheduled = num_scheduled[:num_reqs].astype(np.int64)
        evicted = self.rows.evicted[table_rows]
        cached_after = computed - evicted + scheduled
        self.rows.cached[table_rows] = cached_after
        policy_index = self.rows.policy[table_rows]
        policies = self.rows.policies.policies

        keep = np.full(num_reqs, -1, dtype=np.int64)
        compactions: list[Compaction] = []
        for request_id, kept in plan.keep.items():  # only the requests that evict now
            row = view.batch_row(request_id)
            expected = plan.cached.get(request_id)
            if expected is not None and expected != cached_after[row]:
                raise RuntimeError(
                    f"vllm_evict: worker and scheduler disagree on request {request_id}: the worker has "
                    f"{cached_after[row]} tokens cached after this step, the scheduler planned {expected}")
            keep[row] = kept
            compactions.append(Compaction(request_id, int(computed[row] + scheduled[row]), kept))

        present = sorted(set(policy_index[policy_index >= 0].tolist()))
        if not present:  # no request in the batch has eviction on: nothing to time, only the slots' record
            self._record_slots(view, num_tokens)
            return None
        initializers, _ = state_initializers([policies[i] for i in present])
        zero_states = self._zeroed_states(initializers)
        prompt = view.prompt
        windows = self._windows(table_rows, present, policy_index, computed, scheduled, cached_after, prompt, keep)

        record = self._record(view, num_reqs, num_tokens, computed, scheduled, windows)
        step = StepPlan(record=record, groups=[], ring_positions=self.buffers.ring_positions,
                        zero_states=zero_states, copies=self._copies(plan))
        record_step(self.buffers.positions, self.buffers.states, step)

        every_step = np.array([p.needs_every_step for p in policies] + [False], dtype=bool)[policy_index]
        acting = (policy_index >= 0) & ((keep >= 0) | every_step | windows.adds_mass | windows.reset)
        rows_by_id: dict[str, int] = {}
        if acting.any():
            phase = phase_codes(computed, scheduled, prompt)
            # One group per method (and choice options), phase and whether it evicts: rows differing only in
            # numbers (seeds, budgets, windows, ...) are scored together, each with its own.
            group = np.where(policy_index >= 0, self.rows.policies.group[np.maximum(policy_index, 0)], -1)
            key = (group * 3 + phase) * 2 + (keep >= 0)
            for k in np.unique(key[acting]):
                rows = np.nonzero(acting & (key == k))[0]
                step.groups.append(self._group(view, rows, policies[int(policy_index[rows[0]])],
                                               PHASES[int(phase[rows[0]])], keep, computed, scheduled,
                                               cached_after, windows, plan.pages))
                rows_by_id.update({view.req_ids[r]: int(r) for r in rows})
        return BuiltStep(plan=step, initializers=initializers, num_tokens=num_tokens, compactions=compactions,
                         rows=rows_by_id, relocations=dict(plan.pages))

    def _zeroed_states(self, initializers: list[Policy]) -> tuple[str, ...]:
        """Every state buffer the step's tokens start at 0 in: all but those ``initializers`` compute. A
        page may reach a request of another method through the prefix cache, so each new token's slot
        gets every state, not only those of the methods in this step (engine/prefix_sharing.py)."""
        computed = {name for policy in initializers for name in policy.computed_state}
        return tuple(name for name in self.buffers.states if name not in computed)

    def _record_slots(self, view: RunnerView, num_tokens: int) -> None:
        """A step without eviction still writes its tokens' positions and zero states: a later request
        with eviction may find these pages in the prefix cache and reads both (one write per buffer for
        all layers)."""
        slots = view.slot_mapping(num_tokens)
        record = Record(pages=slots // self.page_size, offsets=slots % self.page_size,
                        positions=view.positions(num_tokens).to(torch.int32), ring_index=None)
        record_step(self.buffers.positions, self.buffers.states,
                    StepPlan(record=record, groups=[], ring_positions=None, zero_states=self._zeroed_states([])))

    def _copies(self, plan: EvictionPlan) -> tuple[Tensor, Tensor] | None:
        """The step's page copies (prefix caching, engine/prefix_sharing.py) as two device index tensors."""
        if not plan.copies:
            return None
        pairs = np.array([(s, d) for src, dst in plan.copies.values() for s, d in zip(src, dst)], dtype=np.int64)
        src, dst = self.staging.to_device(pairs[:, 0], pairs[:, 1])
        return src, dst

    def _windows(self, table_rows: np.ndarray, present: list[int], policy_index: np.ndarray, computed: np.ndarray,
                 scheduled: np.ndarray, cached_after: np.ndarray, prompt: np.ndarray,
                 keep: np.ndarray) -> "RowWindows":
        """Each batch row's observation window in this step (``schedule.window_end``): the queries that join
        it, its size after them, its logit gain, whether the step reads it; the elastic rows, whose
        queries go to the ring instead; and, on a server with a ring, the fixed-mode rows whose window's
        queries wait there. Updates the rows' window counts (``table_rows``: where they are kept)."""
        table = self.rows.policies
        num_reqs = len(table_rows)
        count = self.rows.window[table_rows]
        recorded = np.zeros(num_reqs, dtype=np.int64)
        reset = np.zeros(num_reqs, dtype=bool)
        ring = np.zeros(num_reqs, dtype=bool)
        gain = np.full(num_reqs, np.nan, dtype=np.float64)
        logical_after = computed + scheduled
        for index in present:
            config, policy = table.configs[index], table.policies[index]
            rows = np.nonzero(policy_index == index)[0]
            if not policy.accumulates_window:
                continue
            if config.elastic:  # compressed at any step: its latest queries are kept in the ring
                ring[rows] = True
                continue
            n = len(rows)
            evicting = keep[rows] >= 0
            end = window_end(cached_after=cached_after[rows], scheduled=scheduled[rows],
                             logical_after=logical_after[rows], prompt=prompt[rows], evicting=evicting,
                             budget=np.full(n, config.budget), slack=np.full(n, config.slack_for(self.page_size)),
                             one_shot=np.full(n, config.schedule == "oneshot"),
                             at_prompt_end=np.full(n, policy.window_at_prompt_end),
                             in_decode=np.full(n, policy.window_in_decode))
            recorded[rows] = end.recorded(cached_after[rows], scheduled[rows], policy.window_size(end.logical, end.kept))
            row_gain = policy.window_gain(end.logical, end.kept, self.buffers.geometry.head_size)
            if row_gain is not None:
                gain[rows] = row_gain
            reset[rows] = end.now
        after = count + recorded
        self.rows.window[table_rows] = np.where(reset, 0, after)
        slots = self.rows.slot[table_rows]
        lent = self.rows.window_pages[slots]
        deferred = lent[:, 0] != NO_PAGE if lent.shape[1] else np.zeros(num_reqs, dtype=bool)
        group = self.buffers.geometry.group
        capacity = window_capacity((lent != NO_PAGE).sum(axis=1), group, self.page_size)
        queued = self.rows.window_queued[slots] + np.where(deferred, recorded, 0)
        if (queued > capacity).any():
            row = int(np.argmax(queued > capacity))
            raise RuntimeError(f"vllm_evict: a request has {queued[row]} window queries for lent pages that hold "
                               f"{capacity[row]}: the scheduler lent too few")
        self.rows.window_queued[slots] = np.where(reset, 0, queued)
        return RowWindows(recorded=recorded, count=after, gain=gain, reset=reset, ring=ring, lent=lent,
                          queued=queued, capacity=capacity, group=group)

    def _record(self, view: RunnerView, num_reqs: int, num_tokens: int, computed: np.ndarray,
                scheduled: np.ndarray, windows: RowWindows) -> Record:
        slots = view.slot_mapping(num_tokens)
        ring_index = ring_tokens = None
        staged: list[np.ndarray] = []
        if self.buffers.window and windows.ring.any():
            token_rows = np.repeat(np.arange(num_reqs), scheduled)
            entries, tokens = ring_entries(token_rows, self.rows.slot[view.rows], view.query_pos(num_tokens),
                                           scheduled, computed, self.buffers.window, windows.ring)
            staged = [entries] if tokens is None else [entries, tokens]
        writes = self._window_writes(view, computed, scheduled, windows) if windows.to_pages.any() else ()
        copied = self.staging.to_device(*staged, *writes) if staged or writes else []
        if staged:
            ring_index = copied[0]
            ring_tokens = copied[1] if len(staged) == 2 else None
        window_writes = None
        if writes:
            window_writes = (WindowWrites(rows=copied[-1], query_heads=self.buffers.geometry.query_heads)
                             if self.slot_rows is not None else WindowWrites(k=copied[-2], v=copied[-1]))
        return Record(pages=slots // self.page_size, offsets=slots % self.page_size,
                      positions=view.positions(num_tokens).to(torch.int32), ring_index=ring_index,
                      ring_tokens=ring_tokens, window_writes=window_writes)

    def _window_writes(self, view: RunnerView, computed: np.ndarray, scheduled: np.ndarray,
                       windows: RowWindows) -> tuple[np.ndarray, ...]:
        """Where this step's window queries of rows with lent pages go: where the slots are rows, [3, m]
        (row, token, query head); else [4, n] (token, group member, page, offset) for the slots in K halves
        and in V halves (both always, so that a layer's operations do not depend on where the step's
        entries fall)."""
        rows = np.nonzero(windows.to_pages)[0]
        recorded = windows.recorded[rows]
        token_rows = np.repeat(rows, recorded)
        first = scheduled[rows] - recorded  # each row's last ``recorded`` tokens of this step
        within = np.arange(len(token_rows)) - np.repeat(np.cumsum(recorded) - recorded, recorded)
        in_row = np.repeat(first, recorded) + within
        where = (windows.lent[token_rows], view.query_start[token_rows] + in_row, computed[token_rows] + in_row,
                 windows.capacity[token_rows], windows.group, self.page_size)
        return write_table(*where) if self.slot_rows is None else (write_rows(*where, self.slot_rows),)

    def _group(self, view: RunnerView, rows: np.ndarray, policy: Policy, phase: Phase, keep: np.ndarray,
               computed: np.ndarray, scheduled: np.ndarray, cached_after: np.ndarray, windows: "RowWindows",
               relocated: dict[str, list[int]]) -> Group:
        lengths = cached_after[rows]
        pages = -(-int(lengths.max()) // self.page_size)
        table_rows = view.rows[rows]  # ``rows`` are batch rows
        table = view.block_table(table_rows, pages, self.staging.to_device)
        if relocated:  # rows that copied shared pages in this step read and write the copies
            moved = [(i, relocated[view.req_ids[r]]) for i, r in enumerate(rows) if view.req_ids[r] in relocated]
            if moved:
                new = np.zeros((len(moved), pages), dtype=np.int64)
                for j, (_, row_pages) in enumerate(moved):
                    new[j, :min(len(row_pages), pages)] = row_pages[:pages]
                at, new_t = self.staging.to_device(np.array([i for i, _ in moved], dtype=np.int64), new)
                table = table.clone()
                table[at] = new_t.to(table.dtype)
        entries = self.rows.policy[table_rows]
        evicting = bool(keep[rows[0]] >= 0)
        return build_group(policy, phase, table, self.page_size, lengths=lengths, computed=computed[rows],
                           scheduled=scheduled[rows], seed=self.rows.policies.seed[entries],
                           keep=keep[rows] if evicting else None,
                           ring_rows=self.rows.slot[table_rows] if windows.ring[rows[0]] else None,
                           token_starts=view.query_start[rows],
                           window=windows.step(rows, policy), row_options=row_options(self.rows.policies, policy, entries),
                           to_device=self.staging.to_device, slot_rows=self.slot_rows)


def row_options(table: Any, policy: Policy, entries: np.ndarray) -> dict[str, np.ndarray]:
    """The numeric options (and query windows) that differ between the rows of a group whose rows use
    ``entries`` of the policy table: per row, int64 for an int option, float64 for a float one."""
    out: dict[str, np.ndarray] = {}
    options = policy.all_options()
    for name in (*policy.row_option_names(), "query_window"):
        numbers = table.numbers.get(name)
        if numbers is None or (name != "query_window" and options[name] is None):
            continue
        values = numbers[entries]
        if (values != values[0]).any():
            out[name] = values if isinstance(options.get(name), float) else values.astype(np.int64)
    return out


# ---- elastic mode: compression before the forward ------------------------------------------------
def compress_before_forward(runner: Any, plan: EvictionPlan) -> None:
    """Compact the requests the scheduler compressed for this step (``plan.compress``), before the
    forward writes anything into the pages they gave back, then give them their new page lists.

    A victim may be in the batch or parked out of it (engine/rows.py); it is scored on its cache as the
    last step left it, with the latest queries of its window, and adds no token."""
    rows, layers = runner.evict_rows, runner.evict_layers
    view: RunnerView = runner.evict_view
    staging = runner.evict_builder.staging
    page = runner.evict_buffers.geometry.page_size
    victims = []
    for request_id, keep in plan.compress.items():
        row = view.row_of(request_id)
        evicted, cached, policy, slot, _ = rows.parked[request_id] if row is None else (
            int(rows.evicted[row]), int(rows.cached[row]), int(rows.policy[row]), int(rows.slot[row]), 0)
        if cached != plan.compress_cached[request_id]:
            raise RuntimeError(f"vllm_evict: worker and scheduler disagree on request {request_id}: the worker "
                               f"has {cached} tokens cached, the scheduler compresses from "
                               f"{plan.compress_cached[request_id]}")
        logical = cached + evicted
        phase = 2 if logical >= view.prompt_len(request_id) else 0
        victims.append((request_id, row, evicted, cached, policy, slot, keep, phase))
    groups = []
    policies = rows.policies
    for key in sorted({(int(policies.group[v[4]]), v[7]) for v in victims}):
        members = [v for v in victims if (int(policies.group[v[4]]), v[7]) == key]
        width = max(-(-v[3] // page) for v in members)
        table = view.page_table([v[0] for v in members], width, staging.to_device)
        column = lambda i: np.array([v[i] for v in members], dtype=np.int64)  # noqa: E731
        entries = column(4)
        policy = policies.policies[int(entries[0])]
        groups.append(build_group(
            policy, PHASES[key[1]], table, page,
            lengths=column(3), computed=column(3) + column(2), scheduled=np.zeros(len(members), dtype=np.int64),
            seed=policies.seed[entries], keep=column(6),
            ring_rows=column(5) if runner.evict_buffers.ring is not None else None,
            token_starts=np.zeros(len(members), dtype=np.int64), row_options=row_options(policies, policy, entries),
            to_device=staging.to_device))
    device = runner.evict_buffers.geometry.device
    nothing = torch.zeros(0, dtype=torch.int64, device=device)
    step = StepPlan(record=Record(pages=nothing, offsets=nothing, positions=nothing.to(torch.int32), ring_index=None),
                    groups=groups, ring_positions=runner.evict_buffers.ring_positions)
    geometry = runner.evict_buffers.geometry
    no_queries = torch.zeros(0, geometry.query_heads, geometry.head_size, dtype=geometry.dtype, device=device)
    for cache in layers:
        evict_layer(cache, step, no_queries)
    for request_id, row, evicted, cached, policy, slot, keep, _ in victims:
        pages = plan.compress_pages[request_id]
        view.set_pages(request_id, row, pages)
        values = (evicted + cached - keep, keep, policy, slot, 0)  # elastic rows keep no accumulated window
        if row is None:
            rows.parked[request_id] = values
            continue
        rows.evicted[row], rows.cached[row] = values[0], values[1]


# ---- window pages given back before the forward ----------------------------------------------------
def window_read_gains(policies: Any, entries: np.ndarray, cached: np.ndarray, logical: np.ndarray, page: int,
                      head_size: int) -> np.ndarray | None:
    """The logit gain each row's window read would use (None: 1): its decode eviction's, at budget + slack."""
    gains = np.full(len(entries), np.nan)
    for entry in np.unique(entries):
        rows = entries == entry
        config, policy = policies.configs[int(entry)], policies.policies[int(entry)]
        end = config.budget + config.slack_for(page)
        gain = policy.window_gain(logical[rows] + end - cached[rows], np.full(int(rows.sum()), config.budget), head_size)
        if gain is not None:
            gains[rows] = gain
    return None if np.isnan(gains).all() else gains


def return_window_pages(runner: Any, request_ids: list[str]) -> None:
    """The scheduler took back these requests' lent window pages (engine/window_lender.py) and may hand
    them to another request in this very step: before the forward writes anything, the mass of the
    window queries they hold is added to each request's window state (its window goes on, accumulated
    from now on), then the loan ends. Batched per policy, like ``compress_before_forward``."""
    rows, view = runner.evict_rows, runner.evict_view
    buffers = runner.evict_buffers
    page, group = buffers.geometry.page_size, buffers.geometry.group
    victims = []
    for request_id in request_ids:
        slot = rows.slot_of.get(request_id)
        if slot is None:
            continue
        if rows.window_queued[slot] > 0:
            row = view.row_of(request_id)
            evicted, cached, policy, _, count = rows.parked[request_id] if row is None else (
                int(rows.evicted[row]), int(rows.cached[row]), int(rows.policy[row]), slot, int(rows.window[row]))
            victims.append((request_id, slot, evicted, cached, policy, count))
    policies = rows.policies
    for group_id in sorted({int(policies.group[v[4]]) for v in victims}):
        members = [v for v in victims if int(policies.group[v[4]]) == group_id]
        column = lambda i: np.array([v[i] for v in members], dtype=np.int64)  # noqa: E731
        slots, cached, logical, entries = column(1), column(3), column(3) + column(2), column(4)
        policy = policies.policies[int(entries[0])]
        gain = window_read_gains(policies, entries, cached, logical, page, buffers.geometry.head_size)
        lent = rows.window_pages[slots]
        table = view.page_table([v[0] for v in members], max(-(-int(cached.max()) // page), 1),
                                runner.evict_builder.staging.to_device)
        window = WindowStep(recorded=np.zeros(len(members), dtype=np.int64), count=column(5), gain=gain, lent=lent,
                            queued=rows.window_queued[slots], capacity=window_capacity((lent != NO_PAGE).sum(axis=1), group, page),
                            group=group, flush=True)
        flushed = build_group(policy, Phase.DECODE, table, page, lengths=cached, computed=logical,
                              scheduled=np.zeros(len(members), dtype=np.int64), seed=policies.seed[entries],
                              keep=None, ring_rows=None, token_starts=None, window=window,
                              row_options=row_options(policies, policy, entries),
                              to_device=runner.evict_builder.staging.to_device,
                              slot_rows=runner.evict_builder.slot_rows)
        nothing = flushed.seq_len[:0]
        plan = StepPlan(record=Record(pages=nothing, offsets=nothing, positions=nothing.to(torch.int32),
                                      ring_index=None), groups=[flushed], ring_positions=None)
        geometry = buffers.geometry
        no_queries = torch.zeros(0, geometry.query_heads, geometry.head_size, dtype=geometry.dtype,
                                 device=geometry.device)
        for cache in runner.evict_layers:
            window = page_window(cache, flushed.window_read)
            if fuses_window(cache, flushed):
                add_window_mass(cache, flushed, *window)
            else:
                accumulate_window(cache, flushed, group_inputs(cache, flushed, plan, no_queries), *window)
    for request_id in request_ids:
        slot = rows.slot_of.get(request_id)
        if slot is not None:
            rows.end_window_loan(slot)
