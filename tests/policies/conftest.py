"""The policy tests run thousands of tiny tensor ops: one intra-op thread avoids the thread start-up and
spin-wait overhead that dominates them on a small, shared CPU (measured ~50x on 2 busy cores).

A fixture, not a module-level call: conftest files are imported at collection, so a bare
``torch.set_num_threads(1)`` here would also hold for every engine test in the session (it made the
2k-token passkey test run on one core, 567 s instead of about 290 s)."""

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
