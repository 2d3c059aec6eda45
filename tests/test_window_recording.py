"""``schedule.window_end`` against a simulation of the shared eviction rule: a fixed-mode request's
observation window is accumulated as its queries arrive (the engine keeps no queries), so the queries
the rule records must be exactly those each window read should see. Every way of cutting the prompt
(and replayed outputs) into chunks is explored.

What a window holds when it is read (an eviction in a phase whose policy reads the window, or a prompt
end for a policy that reads it there, AhaKV):
* the last ``window`` queries before it, among the queries since the previous read;
* chunked prefill: only the evicting chunk's own queries (block-wise; the next chunk's size is not
  known when a chunk is computed);
* a request recomputing its outputs after a preemption (``replayed``) may also hold earlier queries
  since the previous read (documented in docs/engine.md): checked as a superset.

Every window read outside a replay is thus a run of consecutive queries ending with the read: the
request's latest ``count`` queries, which is what a request reads from its lent window pages instead of
accumulating them (engine/window_pages.py, tests/engine/test_reference_agreement.py)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from vllm_evict.policies.base import Phase
from vllm_evict.schedule import NO_WINDOW, eviction_target, phase_of, window_end


def wrong_windows(*, prompt_len: int, replayed: int, generated: int, budget: int, schedule: str, slack: int,
                  chunk: int, window: int, at_prompt_end: bool = False, in_decode: bool = True) -> list:
    """(read's last position, expected window, recorded window) for every window read that is wrong."""
    in_chunks, total = prompt_len + replayed, prompt_len + replayed + generated
    wrong: list = []
    one = lambda value: np.array([value])  # noqa: E731

    @functools.lru_cache(maxsize=None)  # the walk meets the same step many times: ask the rule once
    def rule(held: int, size: int, tokens: int, evicting: bool) -> tuple[int, bool]:
        end = window_end(cached_after=one(held), scheduled=one(size), logical_after=one(tokens + size),
                         prompt=one(prompt_len), evicting=one(evicting), budget=one(budget), slack=one(slack),
                         one_shot=one(schedule == "oneshot"), at_prompt_end=one(at_prompt_end),
                         in_decode=one(in_decode))
        return int(end.recorded(one(held), one(size), one(window))[0]), bool(end.now[0])

    def walk(tokens: int, cached: int, recorded: frozenset, since: int) -> None:
        """``recorded``: positions accumulated since the last read, which was at logical length ``since``."""
        if tokens == total:
            return
        for size in (range(1, min(chunk, in_chunks - tokens) + 1) if tokens < in_chunks else (1,)):
            held = cached + size
            phase = phase_of(tokens, size, prompt_len)
            keep = eviction_target(phys_after=held, phase=phase, budget=budget, schedule=schedule, slack=slack)
            count, reads_now = rule(held, size, tokens, keep is not None)
            now = recorded | frozenset(range(tokens + size - count, tokens + size))
            reads = (keep is not None and (phase is not Phase.DECODE or in_decode)) or (
                phase is Phase.PROMPT_END and at_prompt_end)
            assert reads_now == reads
            if reads:
                last = tokens + size
                start = max(since, last - window)
                if schedule == "chunked" and phase is not Phase.DECODE and keep is not None:
                    start = max(start, tokens)  # block-wise
                expected = frozenset(range(start, last))
                replaying = tokens + size > prompt_len and tokens < in_chunks  # the step recomputes outputs
                if (now != expected) if not replaying else not (expected <= now and min(now, default=since) >= since):
                    wrong.append((last, sorted(expected), sorted(now)))
                walk(tokens + size, held if keep is None else keep, frozenset(), last)
            else:
                walk(tokens + size, held if keep is None else keep, now, since)

    walk(0, 0, frozenset(), 0)
    return wrong


GRID = list(itertools.product(
    (1, 6, 11),  # prompt_len
    (0, 3),  # replayed outputs (a request resumed after preemption)
    (0, 7),  # generated one per step
    (2, 5),  # budget
    ("chunked", "oneshot"),
    (1, 5),  # slack (>= 1), below and above the window
    (1, 4),  # chunk
    (1, 3, 8),  # window
))


@pytest.mark.parametrize("prompt_len,replayed,generated,budget,schedule,slack,chunk,window", GRID)
def test_each_window_read_sees_exactly_its_queries(prompt_len, replayed, generated, budget, schedule, slack, chunk,
                                                   window):
    wrong = wrong_windows(prompt_len=prompt_len, replayed=replayed, generated=generated, budget=budget,
                          schedule=schedule, slack=slack, chunk=chunk, window=window)
    assert not wrong, f"windows read with the wrong queries (end, expected, recorded): {wrong[:3]}"


@pytest.mark.parametrize("prompt_len,schedule,chunk", list(itertools.product((1, 6, 11), ("chunked", "oneshot"), (1, 4))))
def test_a_policy_reading_its_window_at_the_prompt_end(prompt_len, schedule, chunk):
    # AhaKV: the prompt's last queries are read at its end whether or not it evicts there; decode evictions
    # read no window, so nothing is recorded while decoding.
    wrong = wrong_windows(prompt_len=prompt_len, replayed=0, generated=9, budget=5, schedule=schedule, slack=2,
                          chunk=chunk, window=3, at_prompt_end=True, in_decode=False)
    assert not wrong, wrong[:3]


def test_decode_windows_of_a_policy_without_them_record_nothing():
    one = lambda value: np.array([value])  # noqa: E731
    end = window_end(cached_after=one(30), scheduled=one(1), logical_after=one(40), prompt=one(20),
                     evicting=one(False), budget=one(28), slack=one(4), one_shot=one(True),
                     at_prompt_end=one(True), in_decode=one(False))
    assert end.length[0] == NO_WINDOW and end.recorded(one(30), one(1), one(8))[0] == 0


def test_one_query_later_would_be_missing():
    # The rule is tight: a window end one token later than the rule's loses a query a read needs.
    import vllm_evict.schedule as schedule

    original = window_end

    def late(**kwargs):
        end = original(**kwargs)
        return schedule.WindowEnd(length=np.where(end.now, end.length, end.length + 1), evicts=end.evicts,
                                  logical=end.logical, kept=end.kept, now=end.now)

    assert wrong_windows(prompt_len=3, replayed=0, generated=12, budget=4, schedule="chunked", slack=2, chunk=4,
                         window=3) == []
    globals()["window_end"] = late
    try:
        assert wrong_windows(prompt_len=3, replayed=0, generated=12, budget=4, schedule="chunked", slack=2, chunk=4,
                             window=3) != []
    finally:
        globals()["window_end"] = original
