"""The eviction runner on vLLM's V1 model runner (``vllm/v1/worker/gpu_model_runner.py`` and its CPU
subclass): the runner's hooks, and the ``RunnerView`` over its persistent ``InputBatch``.

- ``_update_states`` (start of a step, before vLLM adds, removes and moves rows): last step's
  compactions truncate the block table; elastic compressions run; finished and preempted requests are
  forgotten (their ring slots are free for this step's new requests);
- ``_prepare_inputs`` (vLLM has written positions, ``seq_lens`` and the slot mapping): the step is
  built, which makes ``seq_lens``, its host upper bound and the slot mapping physical in place;
- row moves: hooks on ``InputBatch`` and its block table (engine/rows.py ``install_row_hooks``).

In V1 a table row is the batch row: ``InputBatch`` keeps the running requests in its first rows and
moves them (``condense``, ``swap_states``) to keep it so.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_evict.engine.cuda_graphs import guard_v1_dispatcher
from vllm_evict.engine.plan import PLAN_ATTR
from vllm_evict.engine.rows import RowTable, install_row_hooks
from vllm_evict.engine.runner import EvictRunnerMixin
from vllm_evict.engine.runner_view import ToDevice


class V1View:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.max_rows = int(runner.input_batch.max_num_reqs)
        self._arange = np.arange(self.max_rows, dtype=np.int64)

    @property
    def batch(self) -> Any:
        return self.runner.input_batch  # vLLM may build a new one when it initializes the KV cache

    # ---- this step's batch ---------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    @property
    def req_ids(self) -> Sequence[str]:
        return self.batch.req_ids

    @property
    def rows(self) -> np.ndarray:
        return self._arange[: self.batch.num_reqs]

    @property
    def computed(self) -> np.ndarray:
        return self.batch.num_computed_tokens_cpu[: self.batch.num_reqs].astype(np.int64)

    @property
    def prompt(self) -> np.ndarray:
        return self.batch.num_prompt_tokens[: self.batch.num_reqs].astype(np.int64)

    @property
    def query_start(self) -> np.ndarray:
        return self.runner.query_start_loc.np[: self.batch.num_reqs + 1]

    def batch_row(self, request_id: str) -> int:
        return self.batch.req_id_to_index[request_id]

    def query_pos(self, num_tokens: int) -> np.ndarray:
        return self.runner.query_pos.np[:num_tokens]

    def positions(self, num_tokens: int) -> Tensor:
        return self.runner.positions[:num_tokens]

    def slot_mapping(self, num_tokens: int) -> Tensor:
        return self.batch.block_table[0].slot_mapping.gpu[:num_tokens]

    def block_table(self, rows: np.ndarray, pages: int, to_device: ToDevice) -> Tensor:
        (index,) = to_device(rows)
        return self.batch.block_table[0].block_table.gpu[:, :pages].index_select(0, index)

    def make_lengths_physical(self, evicted: np.ndarray, shift: Tensor, num_tokens: int, to_device: ToDevice) -> None:
        runner, num_reqs = self.runner, self.batch.num_reqs
        runner.seq_lens[:num_reqs] -= shift.to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= torch.from_numpy(evicted).to(runner.optimistic_seq_lens_cpu.dtype)
        token_rows = runner.req_indices.gpu[:num_tokens]
        physical = runner.positions[:num_tokens] - shift[token_rows].to(runner.positions.dtype)
        self.batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical)

    # ---- requests between steps ------------------------------------------------------------------
    def held_rows(self) -> dict[str, int]:
        return dict(self.batch.req_id_to_index)

    def row_of(self, request_id: str) -> int | None:
        if request_id not in self.runner.requests:
            return None
        return self.batch.req_id_to_index.get(request_id)

    def prompt_len(self, request_id: str) -> int:
        return len(self.runner.requests[request_id].prompt_token_ids or ())

    def page_table(self, request_ids: Sequence[str], width: int, to_device: ToDevice) -> Tensor:
        table = np.zeros((len(request_ids), width), dtype=np.int64)
        for i, request_id in enumerate(request_ids):
            pages = self.runner.requests[request_id].block_ids[0][:width]
            table[i, :len(pages)] = pages
        return to_device(table)[0].to(torch.int32)

    def truncate_pages(self, request_id: str, row: int, pages: int) -> None:
        request = self.runner.requests.get(request_id)
        if request is None:
            return
        del request.block_ids[0][pages:]
        table = self.batch.block_table[0]
        held = int(table.num_blocks_per_row[row])
        table.block_table.np[row, pages:held] = 0
        table.num_blocks_per_row[row] = min(held, pages)

    def set_pages(self, request_id: str, row: int | None, pages: list[int]) -> None:
        request = self.runner.requests.get(request_id)
        if request is None:  # gone before this step
            return
        request.block_ids[0][:] = pages
        if row is None:  # out of the batch: vLLM writes the row from block_ids when it comes back
            return
        table = self.batch.block_table[0]
        held = int(table.num_blocks_per_row[row])
        table.block_table.np[row, :len(pages)] = pages
        table.block_table.np[row, len(pages):max(held, len(pages))] = 0
        table.num_blocks_per_row[row] = len(pages)


class EvictV1RunnerMixin(EvictRunnerMixin):
    """Put in front of vLLM's V1 GPUModelRunner (or its CPUModelRunner) by class swap, see worker.py."""

    def _make_view(self) -> V1View:
        return V1View(self)

    def _track_rows(self, rows: RowTable) -> None:
        install_row_hooks(self.input_batch, rows)  # type: ignore[attr-defined]

    def _guard_cuda_graphs(self) -> bool:
        return guard_v1_dispatcher(self)

    def _update_states(self, scheduler_output: Any) -> Any:
        rows = self.evict_rows
        if rows is None:
            return super()._update_states(scheduler_output)  # type: ignore[misc]
        self._begin_step(scheduler_output)
        for request_id in (*scheduler_output.finished_req_ids, *(scheduler_output.preempted_req_ids or ())):
            rows.forget(request_id)  # before vLLM adds this step's new requests: their ring slots are free
        try:
            return super()._update_states(scheduler_output)  # type: ignore[misc]
        finally:
            rows.forgotten.clear()

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        self._build_step(getattr(scheduler_output, PLAN_ATTR, None), num_scheduled_tokens)
        return result

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            # A forward outside a scheduled step (data-parallel dummy runs, profiling) must never evict.
            self.evict_step = None
            self.evict_layer_step = False
