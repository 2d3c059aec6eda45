"""Time the worker spends in eviction during one engine step (scoring, state updates, compaction).

The runner wraps each layer's eviction work in ``with timer:``; the worker hands ``timer.take()`` to the
scheduler with the step's output (``engine/stats.py``). On CUDA the work is asynchronous, so a pair of
CUDA events brackets each layer's work and the elapsed times are read in ``take()``, which runs after the
step's sampling has synchronised the stream; on CPU the wall clock is exact.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepTimer:
    """Accumulates eviction time over the layers of a step. Not reentrant (layers run one at a time)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.seconds = 0.0
        self.measured = False
        self._events: list[tuple[Any, Any]] = []
        self._start: Any = None

    def __enter__(self) -> "StepTimer":
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self.seconds += time.perf_counter() - self._start
        self.measured = True

    def take(self) -> float | None:
        """Seconds measured since the last ``take()``, or None when no eviction work ran."""
        if not self.measured:
            return None
        seconds = self.seconds
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1000.0  # milliseconds
        self.seconds, self.measured, self._events = 0.0, False, []
        return seconds
