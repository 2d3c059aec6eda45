"""Time the worker spends in eviction during each engine step (scoring, state updates, compaction).

The runner wraps each layer's eviction work in ``with timer:``; the worker ends each step with
``timer.take()`` and hands what it returns to the scheduler with the step's output (``engine/stats.py``).

On CPU the wall clock is exact and a step's time is known when the step ends. On CUDA the work is
asynchronous: a pair of CUDA events brackets each layer's work, and ``take()`` reads only the steps whose
last event has completed (``Event.query()``, which does not wait); the others stay pending and come out of
a later ``take()``, a step or two later. So the per-step path never waits for the device to time it (with
async scheduling the host is a step ahead of the device, and a wait would stall it); the metrics get each
step's time late, never wrong. ``flush()`` waits for the pending steps (benchmarks, at the end of a run).
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch


class TimedStep(NamedTuple):
    step: int  # the worker's step, counted by ``take()`` calls (one per engine step)
    seconds: float  # time in eviction during that step


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """Accumulates eviction time over the layers of a step. Not reentrant (layers run one at a time).
    ``event``: the device event factory (CUDA events on a CUDA device; tests pass their own)."""

    def __init__(self, device: torch.device | str | None = None, event: Callable[[], Any] | None = None) -> None:
        self.device_events = event is not None or torch.device(device or "cpu").type == "cuda"
        self._event = event or _cuda_event
        self.step = 0  # the step being timed now
        self.seconds = 0.0  # this step's time so far (CPU)
        self.measured = False  # this step ran eviction work
        self._events: list[tuple[Any, Any]] = []  # this step's (start, end) pairs (device)
        self._pending: list[tuple[int, list[tuple[Any, Any]]]] = []  # ended steps not read yet, oldest first
        self._start: Any = None
        self._spare: list[Any] = []  # events read already, recorded again later

    def __enter__(self) -> "StepTimer":
        if self.device_events:
            self._start = self._take_event()
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device_events:
            end = self._take_event()
            end.record()
            self._events.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start
        self.measured = True

    def _take_event(self) -> Any:
        return self._spare.pop() if self._spare else self._event()

    @property
    def pending_from(self) -> int:
        """The oldest step whose time is not known yet (every earlier step has been returned by ``take``,
        or had no eviction work)."""
        return self._pending[0][0] if self._pending else self.step

    def take(self) -> list[TimedStep]:
        """End the current step; return the steps whose time is known now, oldest first (steps without
        eviction work are left out). Never waits for the device."""
        ready: list[TimedStep] = []
        if self.measured:
            if self.device_events:
                self._pending.append((self.step, self._events))
            else:
                ready.append(TimedStep(self.step, self.seconds))
        self.step += 1
        self.seconds, self.measured, self._events = 0.0, False, []
        return ready + self._read(wait=False)

    def flush(self) -> list[TimedStep]:
        """The ended steps still pending, waiting for the device (benchmarks, after a run; not per step)."""
        return self._read(wait=True)

    def _read(self, wait: bool) -> list[TimedStep]:
        ready = []
        if wait and self._pending:
            self._pending[-1][1][-1][1].synchronize()
        # A stream's events complete in order: a step is done when its last event is.
        while self._pending and self._pending[0][1][-1][1].query():
            step, events = self._pending.pop(0)
            ready.append(TimedStep(step, sum(start.elapsed_time(end) for start, end in events) / 1000.0))
            self._spare += [event for pair in events for event in pair]
        return ready
