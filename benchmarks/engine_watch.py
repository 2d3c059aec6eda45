"""What the engine benchmarks read from an in-process engine core, in one place (throughput.py on CPU,
gpu_engine.py on the GPU machine): its model runner, vLLM's preemptions, and every engine step timed
whole with the worker's eviction time in it."""

from __future__ import annotations

import time
from typing import Any, Callable


def model_runner(core: Any) -> Any:
    """The model runner of an in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return core.model_executor.driver_worker.worker.model_runner


def count_preemptions(scheduler: Any) -> Callable[[], int]:
    """From now on, count vLLM's preemptions (``Scheduler._preempt_request``); returns the reader."""
    count = [0]
    original = scheduler._preempt_request

    def preempt(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    scheduler._preempt_request = preempt
    return lambda: count[0]


def watch_steps(core: Any, record: Callable[[Any, float, float], None]) -> None:
    """From now on, call ``record(scheduler_output, seconds, eviction_seconds)`` after every engine step
    that computed tokens: the step's wall time, and the part of it the worker's step timer spent evicting
    (read where the worker reports it; 0 for vanilla, which has no timer)."""
    last: list[Any] = [None]
    evicting = [0.0]
    schedule, step_fn = core.scheduler.schedule, core.step_fn
    timer = getattr(model_runner(core), "evict_timer", None)
    if timer is not None:
        take = timer.take

        def taken() -> float | None:
            seconds = take()
            evicting[0] += seconds or 0.0
            return seconds

        timer.take = taken

    def scheduled(*args: Any, **kwargs: Any) -> Any:
        last[0] = schedule(*args, **kwargs)
        return last[0]

    def timed(*args: Any, **kwargs: Any) -> Any:
        last[0], evicting[0] = None, 0.0
        start = time.perf_counter()
        result = step_fn(*args, **kwargs)
        output = last[0]
        if output is not None and output.total_num_scheduled_tokens:
            record(output, time.perf_counter() - start, evicting[0])
        return result

    core.scheduler.schedule, core.step_fn = scheduled, timed
