"""Once per step, before the forward: physical lengths for attention, and the ``StepPlan`` every
layer's hook runs (``vllm_evict.evict_step``).

Everything here is per step, not per layer, and vectorised over the batch's rows with numpy on the
host (vLLM's own per-row arrays, and ours in engine/rows.py); device work is a handful of copies and
index computations, none of which waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_evict.engine.buffers import EvictionBuffers
from vllm_evict.engine.plan import EvictionPlan
from vllm_evict.engine.rows import RowTable
from vllm_evict.evict_step import (
    Group, Record, StepPlan, build_group, evict_layer, record_step, ring_entries, state_initializers,
)
from vllm_evict.policies.base import Phase, Policy
from vllm_evict.schedule import NEVER_RECORD, queries_needed_above
from vllm_evict.staging import Staging

PHASES = (Phase.PREFILL, Phase.PROMPT_END, Phase.DECODE)


@dataclass
class Compaction:
    """A request compacted in this step: applied to vLLM's block table at the start of the next."""

    request_id: str
    logical: int  # logical tokens after this step
    keep: int  # tokens left in cache


@dataclass
class BuiltStep:
    plan: StepPlan
    initializers: list[Policy]
    num_tokens: int
    compactions: list[Compaction]
    rows: dict[str, int]  # request id -> row, for the requests of a group (records, tests)

    @property
    def layer_work(self) -> bool:
        """Whether the per-layer hook has anything to do (queries to record, states to compute, rows to
        look at); most decode steps far from any eviction have none."""
        return self.plan.record.ring_index is not None or bool(self.initializers) or bool(self.plan.groups)


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
        self._record_above: tuple[tuple[int, int], np.ndarray] | None = None  # see ``record_above``

    def record_above(self) -> np.ndarray:
        """Per policy index (and -1, eviction off, last): ``queries_needed_above`` at the ring's width;
        recomputed only when a policy is added or the ring grows."""
        configs, window = self.rows.policies.configs, self.buffers.window
        key = (len(configs), window)
        if self._record_above is None or self._record_above[0] != key:
            above = [queries_needed_above(c, page_size=self.page_size, window=window)
                     if p.window_for(c.budget) > 0 else NEVER_RECORD  # no window: its queries are never read
                     for c, p in zip(configs, self.rows.policies.policies)]
            self._record_above = key, np.array([*above, NEVER_RECORD], dtype=np.int64)
        return self._record_above[1]

    # ---- physical lengths ------------------------------------------------------------------------
    def make_lengths_physical(self, runner: Any, num_reqs: int, num_tokens: int) -> None:
        """Attention reads each row's compacted cache and writes new tokens right after it: subtract the
        row's evicted count from ``seq_lens``, its upper bound and the slot positions (RoPE positions
        stay logical)."""
        evicted = self.rows.evicted[:num_reqs]
        if not evicted.any():
            return
        host = torch.from_numpy(evicted)
        shift = self.evicted_device[:num_reqs]
        self.staging.copy_into(shift, evicted)
        runner.seq_lens[:num_reqs] -= shift.to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= host.to(runner.optimistic_seq_lens_cpu.dtype)
        token_rows = runner.req_indices.gpu[:num_tokens]
        physical = runner.positions[:num_tokens] - shift[token_rows].to(runner.positions.dtype)
        runner.input_batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1],
                                                            physical)

    # ---- the step plan -------------------------------------------------------------------------
    def build(self, runner: Any, plan: EvictionPlan, num_scheduled: np.ndarray) -> BuiltStep | None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        num_tokens = int(num_scheduled[:num_reqs].sum())
        self.staging.begin_step()
        self.make_lengths_physical(runner, num_reqs, num_tokens)

        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        scheduled = num_scheduled[:num_reqs].astype(np.int64)
        evicted = self.rows.evicted[:num_reqs]
        cached_after = computed - evicted + scheduled
        self.rows.cached[:num_reqs] = cached_after
        policy_index = self.rows.policy[:num_reqs]
        policies = self.rows.policies.policies

        keep = np.full(num_reqs, -1, dtype=np.int64)
        compactions: list[Compaction] = []
        for request_id, kept in plan.keep.items():  # only the requests that evict now
            row = batch.req_id_to_index[request_id]
            expected = plan.cached.get(request_id)
            if expected is not None and expected != cached_after[row]:
                raise RuntimeError(
                    f"vllm_evict: worker and scheduler disagree on request {request_id}: the worker has "
                    f"{cached_after[row]} tokens cached after this step, the scheduler planned {expected}")
            keep[row] = kept
            compactions.append(Compaction(request_id, int(computed[row] + scheduled[row]), kept))

        every_step = np.array([p.needs_every_step for p in policies] + [False], dtype=bool)[policy_index]
        acting = (policy_index >= 0) & ((keep >= 0) | every_step)
        present = sorted(set(policy_index[policy_index >= 0].tolist()))
        if not present:  # no request in the batch has eviction on: nothing to record, nothing to time
            return None
        initializers, zero_states = state_initializers([policies[i] for i in present])

        prompt = batch.num_prompt_tokens[:num_reqs].astype(np.int64)
        record = self._record(runner, num_reqs, num_tokens, computed, scheduled,
                              recording=self._recording(policy_index, computed, prompt, cached_after))
        step = StepPlan(record=record, groups=[], ring_positions=self.buffers.ring_positions,
                        zero_states=zero_states)
        record_step(self.buffers.positions, self.buffers.states, step)

        rows_by_id: dict[str, int] = {}
        if acting.any():
            phase = phase_codes(computed, scheduled, prompt)
            key = (policy_index * 3 + phase) * 2 + (keep >= 0)
            for k in np.unique(key[acting]):
                rows = np.nonzero(acting & (key == k))[0]
                step.groups.append(self._group(runner, rows, policies[int(policy_index[rows[0]])],
                                               PHASES[int(phase[rows[0]])], keep, computed, scheduled,
                                               cached_after))
                rows_by_id.update({batch.req_ids[r]: int(r) for r in rows})
        return BuiltStep(plan=step, initializers=initializers, num_tokens=num_tokens, compactions=compactions,
                         rows=rows_by_id)

    def _recording(self, policy_index: np.ndarray, computed: np.ndarray, prompt: np.ndarray,
                   cached_after: np.ndarray) -> np.ndarray:
        """Rows whose queries of this step go to the ring: prompt steps of eviction-on rows, and decode
        steps once the row is near enough to its next eviction (``schedule.queries_needed_above``)."""
        above = self.record_above()[policy_index]  # index -1 picks NEVER_RECORD
        return ((computed < prompt) & (above < NEVER_RECORD)) | (cached_after > above)

    def _record(self, runner: Any, num_reqs: int, num_tokens: int, computed: np.ndarray,
                scheduled: np.ndarray, recording: np.ndarray) -> Record:
        slots = runner.input_batch.block_table[0].slot_mapping.gpu[:num_tokens]
        ring_index = ring_tokens = None
        if self.buffers.window and recording.any():
            token_rows = np.repeat(np.arange(num_reqs), scheduled)
            entries, tokens = ring_entries(token_rows, self.rows.slot[:num_reqs], runner.query_pos.np[:num_tokens],
                                           scheduled, computed, self.buffers.window, recording)
            if tokens is None:
                (ring_index,) = self.staging.to_device(entries)
            else:
                ring_index, ring_tokens = self.staging.to_device(entries, tokens)
        return Record(pages=slots // self.page_size, offsets=slots % self.page_size,
                      positions=runner.positions[:num_tokens].to(torch.int32), ring_index=ring_index,
                      ring_tokens=ring_tokens)

    def _group(self, runner: Any, rows: np.ndarray, policy: Policy, phase: Phase, keep: np.ndarray,
               computed: np.ndarray, scheduled: np.ndarray, cached_after: np.ndarray) -> Group:
        lengths = cached_after[rows]
        pages = -(-int(lengths.max()) // self.page_size)
        (index,) = self.staging.to_device(rows)
        table = runner.input_batch.block_table[0].block_table.gpu[:, :pages].index_select(0, index)
        seed = self.rows.policies.configs[int(self.rows.policy[rows[0]])].seed
        evicting = bool(keep[rows[0]] >= 0)
        return build_group(policy, phase, table, self.page_size, lengths=lengths, computed=computed[rows],
                           scheduled=scheduled[rows], seed=np.full(len(rows), seed, dtype=np.int64),
                           keep=keep[rows] if evicting else None,
                           ring_rows=self.rows.slot[rows] if self.buffers.ring is not None else None,
                           token_starts=runner.query_start_loc.np[rows], to_device=self.staging.to_device)


# ---- elastic mode: compression before the forward ------------------------------------------------
def compress_before_forward(runner: Any, plan: EvictionPlan) -> None:
    """Compact the requests the scheduler compressed for this step (``plan.compress``), before the
    forward writes anything into the pages they gave back, then give them their new page lists.

    A victim may be in the batch or parked out of it (engine/rows.py); it is scored on its cache as the
    last step left it, with the latest queries of its window, and adds no token."""
    rows, layers = runner.evict_rows, runner.evict_layers
    batch = runner.input_batch
    staging = runner.evict_builder.staging
    staging.begin_step()
    page = runner.evict_buffers.geometry.page_size
    victims = []
    for request_id, keep in plan.compress.items():
        row = batch.req_id_to_index.get(request_id)
        evicted, cached, policy, slot = rows.parked[request_id] if row is None else (
            int(rows.evicted[row]), int(rows.cached[row]), int(rows.policy[row]), int(rows.slot[row]))
        if cached != plan.compress_cached[request_id]:
            raise RuntimeError(f"vllm_evict: worker and scheduler disagree on request {request_id}: the worker "
                               f"has {cached} tokens cached, the scheduler compresses from "
                               f"{plan.compress_cached[request_id]}")
        request = runner.requests[request_id]
        logical = cached + evicted
        phase = 2 if logical >= len(request.prompt_token_ids or ()) else 0
        victims.append((request_id, row, evicted, cached, policy, slot, keep, phase, list(request.block_ids[0])))
    groups = []
    for key in sorted({(v[4], v[7]) for v in victims}):
        members = [v for v in victims if (v[4], v[7]) == key]
        width = max(-(-v[3] // page) for v in members)
        table = np.zeros((len(members), width), dtype=np.int64)
        for i, v in enumerate(members):
            table[i, :len(v[8][:width])] = v[8][:width]
        column = lambda i: np.array([v[i] for v in members], dtype=np.int64)  # noqa: E731
        policy = rows.policies.policies[key[0]]
        groups.append(build_group(
            policy, PHASES[key[1]], staging.to_device(table)[0].to(torch.int32), page,  # int32 like vLLM's
            lengths=column(3), computed=column(3) + column(2), scheduled=np.zeros(len(members), dtype=np.int64),
            seed=np.full(len(members), rows.policies.configs[key[0]].seed, dtype=np.int64), keep=column(6),
            ring_rows=column(5) if runner.evict_buffers.ring is not None else None,
            token_starts=np.zeros(len(members), dtype=np.int64), to_device=staging.to_device))
    device = runner.evict_buffers.geometry.device
    nothing = torch.zeros(0, dtype=torch.int64, device=device)
    step = StepPlan(record=Record(pages=nothing, offsets=nothing, positions=nothing.to(torch.int32), ring_index=None),
                    groups=groups, ring_positions=runner.evict_buffers.ring_positions)
    geometry = runner.evict_buffers.geometry
    no_queries = torch.zeros(0, geometry.query_heads, geometry.head_size, dtype=geometry.dtype, device=device)
    for cache in layers:
        evict_layer(cache, step, no_queries)
    table = batch.block_table[0]
    for request_id, row, evicted, cached, policy, slot, keep, _, _ in victims:
        pages = plan.compress_pages[request_id]
        runner.requests[request_id].block_ids[0][:] = pages
        values = (evicted + cached - keep, keep, policy, slot)
        if row is None:
            rows.parked[request_id] = values
            continue
        held = int(table.num_blocks_per_row[row])
        table.block_table.np[row, :len(pages)] = pages
        table.block_table.np[row, len(pages):max(held, len(pages))] = 0
        table.num_blocks_per_row[row] = len(pages)
        rows.evicted[row], rows.cached[row] = values[0], values[1]
