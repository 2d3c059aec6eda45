"""``physical_bound`` against an exhaustive simulation of the shared eviction rule.

Every way the scheduler can cut a request into steps (prompt and replayed outputs in steps of 1..chunk
tokens, generated tokens one per step) is explored. The most tokens held at once (before the step's
eviction) must never exceed the bound; for a request that replays nothing (every fresh request) it
equals the bound. The bound never exceeds what the request holds without eviction.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

import pytest

from vllm_evict.schedule import eviction_target, longest_request_bound, phase_of, physical_bound


def simulated_peak(*, prompt_len: int, replayed: int, generated: int, budget: int, schedule: str, slack: int,
                   chunk: int) -> int:
    in_chunks, total = prompt_len + replayed, prompt_len + replayed + generated

    @lru_cache(maxsize=None)
    def worst(tokens: int, cached: int) -> int:
        if tokens == total:
            return 0
        sizes = range(1, min(chunk, in_chunks - tokens) + 1) if tokens < in_chunks else (1,)
        peak = 0
        for size in sizes:
            held = cached + size
            keep = eviction_target(phys_after=held, phase=phase_of(tokens, size, prompt_len), budget=budget,
                                   schedule=schedule, slack=slack)
            peak = max(peak, held, worst(tokens + size, held if keep is None else keep))
        return peak

    return worst(0, 0)


GRID = list(itertools.product(
    (1, 3, 7, 12),  # prompt_len
    (0, 2, 6),  # replayed
    (0, 1, 6),  # generated after the replay
    (2, 5),  # budget
    ("chunked", "oneshot"),
    (1, 3),  # slack
    (1, 3, 4),  # chunk
))


@pytest.mark.parametrize("schedule", ["chunked", "oneshot"])
def test_bound_equals_the_worst_step_sequence(schedule):
    checked = 0
    for prompt_len, replayed, generated, budget, sched, slack, chunk in GRID:
        if sched != schedule:
            continue
        new = replayed + generated
        bound = physical_bound(prompt_len=prompt_len, max_new_tokens=new, replayed=replayed, budget=budget,
                               schedule=schedule, slack=slack, chunk=chunk)
        peak = simulated_peak(prompt_len=prompt_len, replayed=replayed, generated=generated, budget=budget,
                              schedule=schedule, slack=slack, chunk=chunk)
        case = (prompt_len, replayed, generated, budget, schedule, slack, chunk)
        assert peak <= bound, case
        if replayed == 0:
            assert bound == peak, case
        assert bound <= prompt_len + new
        checked += 1
    assert checked == len(GRID) // 2


def test_eviction_off_holds_everything():
    assert physical_bound(prompt_len=1000, max_new_tokens=100, budget=None, schedule=None, slack=0, chunk=64) == 1100


def test_short_prompt_with_long_generation_reserves_its_prompt_only():
    # Issue 10's example: 200-token prompt, max_tokens 8192, chunk 8192, budget 256, 16-token pages.
    admission = physical_bound(prompt_len=200, max_new_tokens=0, budget=256, schedule="chunked", slack=16,
                               chunk=8192)
    lifetime = physical_bound(prompt_len=200, max_new_tokens=8192, budget=256, schedule="chunked", slack=16,
                              chunk=8192)
    assert admission == 200  # what vanilla vLLM reserves (13 pages of 16)
    assert lifetime == 256 + 16  # grows to budget + slack while decoding, then is evicted back


def test_longest_request_bound():
    # chunked: a long request resumed after preemption replays its outputs in chunks from budget + slack - 1
    assert longest_request_bound(max_model_len=4096, budget=128, schedule="chunked", slack=32,
                                 chunk=64) == 128 + 31 + 64
    assert longest_request_bound(max_model_len=150, budget=128, schedule="chunked", slack=32, chunk=64) == 150
    # one-shot holds the whole prompt before it evicts
    assert longest_request_bound(max_model_len=4096, budget=128, schedule="oneshot", slack=32, chunk=64) == 4096
