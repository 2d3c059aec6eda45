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


def watch_steps(core: Any, record: Callable[[Any, float, float], None]) -> Callable[[], None]:
    """From now on, call ``record(scheduler_output, seconds, eviction_seconds)`` for every engine step that
    computed tokens: the step's wall time, and the part of it the worker's step timer spent evicting (0 for
    vanilla, which has no timer). On a GPU the worker reads its timer a step or two late, without waiting
    (vllm_evict/engine/step_timer.py), so a step is recorded once its eviction time is known; call the
    returned ``flush`` after the run for the last ones (it waits for the device).

    The worker ends one timer step per ``schedule()`` call (its one output per step), so the timer's step
    numbers, counted from now, are the order of this engine's schedules."""
    steps: list[list[Any]] = []  # per schedule() from now on: [output, wall seconds (None: running), eviction]
    delivered = [0]
    schedule, step_fn = core.scheduler.schedule, core.step_fn
    timer = getattr(model_runner(core), "evict_timer", None)
    base = timer.step if timer is not None else 0

    def add(timed: list[Any]) -> None:
        for step, seconds in timed:
            if 0 <= step - base < len(steps):
                steps[step - base][2] += seconds

    def deliver(final: bool = False) -> None:
        known = len(steps) if final or timer is None else timer.pending_from - base
        while delivered[0] < min(known, len(steps)) and steps[delivered[0]][1] is not None:
            output, seconds, eviction = steps[delivered[0]]
            if output.total_num_scheduled_tokens:
                record(output, seconds, eviction)
            delivered[0] += 1

    if timer is not None:
        take = timer.take

        def taken() -> Any:
            timed = take()
            add(timed)
            return timed

        timer.take = taken

    def scheduled(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        steps.append([output, None, 0.0])
        return output

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        before = len(steps)
        start = time.perf_counter()
        result = step_fn(*args, **kwargs)
        if len(steps) > before:  # the step scheduled a batch: its wall time is this call's
            steps[-1][1] = time.perf_counter() - start
        deliver()
        return result

    def flush() -> None:
        if timer is not None:
            add(timer.flush())
        for step in steps:
            step[1] = 0.0 if step[1] is None else step[1]
        deliver(final=True)

    core.scheduler.schedule, core.step_fn = scheduled, timed_step
    return flush
