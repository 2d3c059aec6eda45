"""The sync audit (tests/sync_audit.py) flags every kind of operation that synchronises on CUDA, and
none of the sync-free patterns the per-step path uses instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.sync_audit import SyncAudit
from vllm_evict import dense
from vllm_evict.staging import Staging

DEVICE = torch.device("cpu")  # stands for the engine's device


def dev(*values: int) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)  # made outside any audit: a device tensor


SYNCING = {
    "item": lambda x: x[0].item(),
    "tolist": lambda x: x.tolist(),
    "cpu": lambda x: x.cpu(),
    "numpy": lambda x: x.numpy(),
    "bool": lambda x: bool(x.any()),
    "int": lambda x: int(x.max()),
    "range over a device value": lambda x: range(x.sum()),
    "as_tensor int on device": lambda x: torch.as_tensor(3, device=DEVICE),
    "tensor list on device": lambda x: torch.tensor([1, 2], device=DEVICE),
    "new_tensor": lambda x: x.new_tensor([1, 2]),
    "from_numpy to device": lambda x: torch.from_numpy(np.arange(3)).to(DEVICE, non_blocking=True),
    "host tensor copy_": lambda x: x[:2].copy_(torch.tensor([5, 6]), non_blocking=True),
    "device to host copy_": lambda x: torch.zeros(3).copy_(x[:3]),
    "index with numpy": lambda x: x[np.array([0, 1])],
    "setitem host tensor": lambda x: x.__setitem__(slice(0, 2), torch.tensor([1, 2])),
    "nonzero": lambda x: torch.nonzero(x),
    "boolean mask": lambda x: x[x > 1],
    "masked_select": lambda x: torch.masked_select(x, x > 1),
    "unique": lambda x: torch.unique(x),
    "repeat_interleave": lambda x: torch.repeat_interleave(x, x),
    "bincount": lambda x: torch.bincount(x),
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("case", list(SYNCING))
def test_each_syncing_operation_is_flagged(case):
    x = dev(1, 2, 3, 4)
    with SyncAudit() as audit:
        SYNCING[case](x)
    assert audit.violations, f"{case} synchronises on CUDA but was not flagged"


def test_the_sync_free_patterns_pass():
    x, r = dev(1, 2, 3, 4), dev(1, 2)
    staging = Staging(DEVICE)
    with SyncAudit() as audit:
        staging.begin_step()
        a, b = staging.to_device(np.arange(5), np.ones((2, 3), dtype=np.int64))
        staging.copy_into(x[:3], np.array([7, 8, 9]))
        host = torch.from_numpy(np.arange(4))  # host arithmetic on host tensors is free
        assert int(host.sum()) == 6 and host.tolist() == [0, 1, 2, 3]
        dense.as_rows(5, 4, DEVICE, torch.int64)
        dense.latest_queries(x.view(1, -1), x[:1], 2)
        dense.uniform_hash(x, 3, 7)
        torch.full((4,), 3, device=DEVICE)
        torch.where(x > 2, x, 0)
        torch.repeat_interleave(r, r, output_size=3)
        x.masked_fill(x > 2, 0)
        torch.sort(x, descending=True)
        x.index_select(0, a[:2])
        y = x.to(torch.float32) * 2
        y.to(DEVICE)
    assert not audit.violations, [str(v) for v in audit.violations]
    assert a.tolist() == list(range(5)) and b.shape == (2, 3) and x[:3].tolist() == [7, 8, 9]


def test_a_paused_region_is_not_audited():
    x = dev(1, 2)
    with SyncAudit() as audit:
        with audit.paused():
            x.tolist()
        x.sum()
    assert not audit.violations


def test_the_violation_names_the_vllm_evict_frame():
    x = dev(0, 1, 1)
    with SyncAudit() as audit:
        dense.valid_slots(x, 3)  # fine
        torch.nonzero(x)
    assert len(audit.violations) == 1 and "nonzero" in str(audit.violations[0])
