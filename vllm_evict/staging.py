"""Host-to-device copies of the per-step index arrays that never make the host wait.

A ``non_blocking`` copy from ordinary (pageable) host memory is not asynchronous on CUDA: the driver
stages it through a bounce buffer and returns only once the source has been read, which waits for the
stream. Like vLLM's own input buffers, the worker therefore copies its per-step numpy arrays from
pinned host memory it keeps for the whole run:

* ``Staging`` holds two pinned arenas and uses them in turn, one turn per engine step (the runner calls
  ``begin_step()`` once, at the start of each step). An arena is written again only two steps later, by
  which time the step that read it has finished: vLLM sends a worker step n + 2 only once step n's
  sampled tokens are back on the host, with or without async scheduling (which keeps one step in
  flight), so a turn never overwrites memory a pending copy still reads. Arrays are packed at 16-byte
  boundaries, so the device views keep the same alignment from step to step (Triton specialises on it).
* ``to_device`` without an arena (the HF reference runner, benchmarks): pinned memory from PyTorch's
  caching host allocator, which records the copy's stream and reuses the block only once it is done.

On CPU the same code runs with unpinned arenas (there is no device to wait for), so the engine tests
exercise exactly the calls a GPU runs. ``is_staging`` tells the tests' sync audit which host tensors
are such arenas.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor

_ALIGN = 2  # int64 elements per 16 bytes
_arena_storages: set[int] = set()  # host storage addresses of every live arena (see ``is_staging``)


def is_staging(tensor: Tensor) -> bool:
    """Whether ``tensor`` is (a view of) a staging arena's host memory."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _arena_storages


def _pinned(numel: int, device: torch.device) -> Tensor:
    return torch.empty(numel, dtype=torch.int64, pin_memory=device.type == "cuda")


def _layout(arrays: tuple[np.ndarray, ...]) -> tuple[list[int], int]:
    offsets, at = [], 0
    for a in arrays:
        offsets.append(at)
        at += -(-a.size // _ALIGN) * _ALIGN
    return offsets, at


class Staging:
    """Two persistent host arenas (pinned on CUDA) used in turn, one turn per ``begin_step()``."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = torch.device(device)
        self._arenas = [self._new_arena(capacity), self._new_arena(capacity)]
        self._retired: list[list[Tensor]] = [[], []]  # outgrown arenas, kept until their turn is over
        self._turn = 0
        self._used = 0

    def _new_arena(self, numel: int) -> Tensor:
        arena = _pinned(numel, self.device)
        address = arena.untyped_storage().data_ptr()
        _arena_storages.add(address)
        weakref.finalize(arena, _arena_storages.discard, address)  # freed memory is no arena any more
        return arena

    def begin_step(self) -> None:
        """Switch to the other arena (everything staged two turns ago has been copied by now)."""
        self._turn ^= 1
        self._retired[self._turn] = []
        self._used = 0

    def _reserve(self, numel: int) -> Tensor:
        arena = self._arenas[self._turn]
        if self._used + numel > arena.numel():
            # Outgrown: a larger arena for the rest of this turn; the old one may still be read by copies
            # queued earlier in this turn, so it is kept until the turn comes round again.
            self._retired[self._turn].append(arena)
            arena = self._arenas[self._turn] = self._new_arena(max(2 * arena.numel(), numel))
            self._used = 0
        view = arena[self._used:self._used + numel]
        self._used += numel
        return view

    def to_device(self, *arrays: np.ndarray) -> list[Tensor]:
        """int64 device copies of ``arrays`` (one host-to-device copy for all of them), in order."""
        offsets, total = _layout(arrays)
        host = self._reserve(total)
        flat = host.numpy()
        for a, at in zip(arrays, offsets):
            flat[at:at + a.size] = a.reshape(-1)
        device = torch.empty(total, dtype=torch.int64, device=self.device)
        device.copy_(host, non_blocking=True)
        return [device[at:at + a.size].view(a.shape) for a, at in zip(arrays, offsets)]

    def copy_into(self, out: Tensor, array: np.ndarray) -> None:
        """``out`` (a device tensor of ``array.size`` elements) <- ``array``, without waiting."""
        host = self._reserve(-(-array.size // _ALIGN) * _ALIGN)[:array.size]
        host.numpy()[:] = array.reshape(-1)
        out.copy_(host.view(out.shape), non_blocking=True)


def to_device(*arrays: np.ndarray, device: torch.device) -> list[Tensor]:
    """int64 device copies of ``arrays`` without a persistent arena (callers outside the engine's steps):
    pinned blocks of PyTorch's caching host allocator, reused only once their copy has completed."""
    offsets, total = _layout(arrays)
    host = _pinned(total, torch.device(device))
    flat = host.numpy()
    for a, at in zip(arrays, offsets):
        flat[at:at + a.size] = a.reshape(-1)
    out = host.to(device, non_blocking=True)
    return [out[at:at + a.size].view(a.shape) for a, at in zip(arrays, offsets)]
