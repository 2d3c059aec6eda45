"""What the eviction engine reads from (and changes in) vLLM's model runner, in one interface with one
implementation per runner: ``engine/runner_v1.py`` (the V1 runner, ``vllm/v1/worker/gpu_model_runner.py``)
and ``engine/runner_v2.py`` (Model Runner V2, ``vllm/v1/worker/gpu/model_runner.py``).

Two kinds of rows meet here:

* a **batch row** is a request's index in this step's batch (the order of vLLM's packed token axis);
* a **table row** is the request's row in the worker's ``RowTable`` (engine/rows.py). On V1 it is the
  request's row in vLLM's persistent ``InputBatch``, which is the batch order; on V2 it is the
  request's slot in ``RequestState``, stable for the request's life, and the batch gathers the slots
  through ``idx_mapping``.

Everything per step is host numpy or a device tensor vLLM already holds; nothing here waits for the
device.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
from torch import Tensor

# The worker's host-to-device copy of per-step int64 arrays (``vllm_evict.staging.Staging.to_device``:
# pinned memory on CUDA, so no copy makes the host wait). Every view method that copies host data to the
# device is handed it.
ToDevice = Callable[..., list[Tensor]]


class RunnerView(Protocol):
    max_rows: int  # table rows (vLLM's max_num_seqs)

    # ---- this step's batch (between vLLM's input preparation and the forward) ----------------------
    @property
    def num_reqs(self) -> int: ...

    @property
    def req_ids(self) -> Sequence[str]:
        """Request id of each batch row."""

    @property
    def rows(self) -> np.ndarray:
        """Table row of each batch row [num_reqs]."""

    @property
    def computed(self) -> np.ndarray:
        """Logical tokens cached before this step, per batch row."""

    @property
    def prompt(self) -> np.ndarray:
        """Prompt tokens of each batch row."""

    @property
    def query_start(self) -> np.ndarray:
        """[num_reqs + 1] first token of each batch row in the packed token axis (host)."""

    def batch_row(self, request_id: str) -> int:
        """The batch row of a request scheduled in this step."""

    def query_pos(self, num_tokens: int) -> np.ndarray:
        """Index of each token within its row's tokens of this step (host)."""

    def positions(self, num_tokens: int) -> Tensor:
        """Logical (RoPE) position of each token (device)."""

    def slot_mapping(self, num_tokens: int) -> Tensor:
        """The cache slot each token is written to (device; physical once ``make_lengths_physical`` ran)."""

    def block_table(self, rows: np.ndarray, pages: int, to_device: ToDevice) -> Tensor:
        """The first ``pages`` pages of the given table rows [len(rows), pages] (device)."""

    def make_lengths_physical(self, evicted: np.ndarray, shift: Tensor, num_tokens: int, to_device: ToDevice) -> None:
        """Attention reads each row's compacted cache and writes new tokens right after it: subtract
        each batch row's evicted tokens (host ``evicted``, the same on the device as ``shift``) from the
        sequence lengths attention sees and from the slot positions; RoPE positions stay logical."""

    # ---- requests between steps ----------------------------------------------------------------------
    def held_rows(self) -> dict[str, int]:
        """Table row of every request the runner holds a row for (tests, debugging)."""

    def row_of(self, request_id: str) -> int | None:
        """The request's table row, None when the worker holds none for it (V1: out of the batch)."""

    def prompt_len(self, request_id: str) -> int: ...

    def page_table(self, request_ids: Sequence[str], width: int, to_device: ToDevice) -> Tensor:
        """The first ``width`` pages of each request [len(request_ids), width] (device int32 like vLLM's
        block tables, so the kernels see one dtype; 0 past the end)."""

    def truncate_pages(self, request_id: str, row: int, pages: int) -> None:
        """Keep only the first ``pages`` pages of the request (the scheduler freed the rest); the next
        pages vLLM hands it are appended after them."""

    def set_pages(self, request_id: str, row: int | None, pages: list[int]) -> None:
        """The request's whole page list is now ``pages`` (an elastic compression replaced it, or prefix caching's
        copies did); ``row`` None: the request is out of the batch (V1), or gone (nothing to do)."""
