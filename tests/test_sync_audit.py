"""The sync audit (tests/sync_audit.py) flags every kind of operation that synchronises on CUDA, and
none of the sync-free patterns the per-step path uses instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.sync_audit import SyncAudit
from vllm_evict import dense, ops
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.warmup import WarmupGeometry, warm_up
from vllm_evict.evict_step import Record, StepPlan, device_zero, record_step
from vllm_evict.staging import Staging

DEVICE = torch.device("cpu")  # stands for the engine's device


def dev(*values: int) -> torch.Tensor:
    return torch.tensor(values, device=DEVICE)  # made outside any audit: a device tensor


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def launch(x: torch.Tensor) -> None:
    _add_one[(1,)](x, x.numel(), BLOCK=8)


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


INDEX, CUBE = dev(0, 1), torch.zeros(2, 2, 2, device=DEVICE)  # device tensors, made outside any audit
HOST_VALUE = "writes a host value through tensor indices"
MIXED = "mixes a host tensor with device tensors"
# Host memory reaching the device behind the call's back: (operation, the reason the audit must give).
HOST_MEMORY = {
    # A value written through tensor indices from host memory: index_put_ copies it to the device, blocking.
    "number through tensor indices": (lambda x: x.__setitem__(INDEX, 0), HOST_VALUE),
    "number through tensor indices, 3-d": (lambda x: CUBE.__setitem__((INDEX, slice(None), INDEX), 0.0), HOST_VALUE),
    "index_put_ a host 0-dim tensor": (lambda x: x.index_put_((INDEX,), torch.tensor(5)), HOST_VALUE),
    "host tensor through tensor indices": (lambda x: x.__setitem__(INDEX, torch.tensor([5, 6])), "host"),
    # Host tensors in ops with device tensors: an error on CUDA, or a blocking copy.
    "host index tensor": (lambda x: x[torch.tensor([0, 1])], MIXED),
    "host index_select index": (lambda x: x.index_select(0, torch.arange(2)), MIXED),
    "host operand": (lambda x: x + torch.arange(4), MIXED),
    "host tensor in a kernel launch": (lambda x: launch(torch.zeros(4)), "a host tensor given to a kernel"),
}


@pytest.mark.parametrize("case", list(HOST_MEMORY))
def test_host_memory_reaching_the_device_is_flagged(case):
    operation, reason = HOST_MEMORY[case]
    with SyncAudit() as audit:
        operation(dev(1, 2, 3, 4))
    assert any(reason in v.why for v in audit.violations), (case, [str(v) for v in audit.violations])


def test_the_sync_free_patterns_pass():
    x, r, z = dev(1, 2, 3, 4), dev(1, 2), dev(5, 6, 7, 8)
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
        z[r] = device_zero(z)  # a device value through tensor indices
        z[:1] = 0  # a number through plain indices: a fill
        z.index_fill_(0, r, 0)  # an op's scalar argument
        y * torch.tensor(2.0)  # a 0-dim host tensor is read as a scalar
        launch(y)  # a kernel given device tensors
    assert not audit.violations, [str(v) for v in audit.violations]
    assert audit.launches == 1
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


def test_the_eviction_step_and_its_kernel_launchers_do_not_synchronise():
    """The record phase (positions, the states that start at 0) and the evict phase of methods that
    between them launch every eviction kernel (window masses per KV head and per query head, KeyDiff,
    CAOTE's output error, CriticalKV's value norms, the compaction) and take TOVA's bound on positions,
    every phase, evicting and not, with a window read and reset: on the PyTorch references and on the
    Triton launchers (interpreter)."""
    k, v = torch.randn(2, 1, 8, 16, device=DEVICE), torch.randn(2, 1, 8, 16, device=DEVICE)
    geometry = WarmupGeometry(k=k, v=v, query_heads=2, scale=0.25)
    o_proj = torch.randn(32, 32, device=DEVICE)
    configs = [EvictionConfig.from_spec("keydiff", 64), EvictionConfig.from_spec("criticalkv+h2o", 64),
               EvictionConfig.from_spec("fastcaote+tova", 64, caote_mode="head"), EvictionConfig.from_spec("tova", 64)]
    positions = torch.zeros(2, 2, 1, 8, dtype=torch.int32, device=DEVICE)  # [L, pages, H, bs]
    states = {"acc": torch.ones(2, 2, 1, 8, device=DEVICE)}
    record = Record(pages=dev(1, 1), offsets=dev(3, 4), positions=dev(7, 8).int(), ring_index=None)
    for backend in ("torch", "triton"):
        with ops.use_backend(backend), SyncAudit() as audit:
            record_step(positions, states, StepPlan(record=record, groups=[], ring_positions=None,
                                                    zero_states=("acc",)))
            warm_up(geometry, lambda: o_proj, configs=configs, to_device=Staging(DEVICE).to_device)
        assert not audit.violations, [str(v) for v in audit.violations]
        assert audit.launches > 0 if backend == "triton" else audit.launches == 0
    assert states["acc"][:, 1, 0, 3:5].eq(0).all() and positions[:, 1, 0, 3:5].tolist() == [[7, 8], [7, 8]]
