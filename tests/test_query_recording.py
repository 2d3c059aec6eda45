"""``queries_needed_above`` against a simulation of the shared eviction rule: whenever a fixed-mode
request evicts, the query of each of its last ``window`` logical positions was recorded in the ring
(the worker skips the ring write for decode steps at or below the line), so skipping never changes
what a policy sees. Every way of cutting the prompt (and replayed outputs) into chunks is explored."""

from __future__ import annotations

import itertools

import pytest

from vllm_evict.config import EvictionConfig
from vllm_evict.schedule import NEVER_RECORD, eviction_target, phase_of, queries_needed_above


def missing_queries(*, prompt_len: int, replayed: int, generated: int, budget: int, schedule: str, slack: int,
                    chunk: int, window: int) -> list[tuple[int, int]]:
    """(eviction step's last position, position) of every query an eviction needs that was not recorded."""
    config = EvictionConfig.from_mapping({"policy": "keydiff", "budget": budget, "schedule": schedule, "slack": slack})
    above = queries_needed_above(config, page_size=16, window=window)
    in_chunks, total = prompt_len + replayed, prompt_len + replayed + generated
    missing: list[tuple[int, int]] = []

    def walk(tokens: int, cached: int, recorded: tuple[bool, ...]) -> None:
        if tokens == total:
            return
        for size in (range(1, min(chunk, in_chunks - tokens) + 1) if tokens < in_chunks else (1,)):
            held = cached + size
            records = tokens < prompt_len or held > above  # the worker's rule (StepBuilder._recording)
            now = recorded + tuple(records and i >= size - window for i in range(size))
            keep = eviction_target(phys_after=held, phase=phase_of(tokens, size, prompt_len), budget=budget,
                                   schedule=schedule, slack=slack)
            if keep is not None:
                last = tokens + size
                missing.extend((last, p) for p in range(max(0, last - window), last) if not now[p])
            walk(tokens + size, held if keep is None else keep, now)

    walk(0, 0, ())
    return missing


GRID = list(itertools.product(
    (1, 6, 11),  # prompt_len
    (0, 3),  # replayed outputs (a request resumed after preemption)
    (0, 9),  # generated one per step
    (2, 5),  # budget
    ("chunked", "oneshot"),
    (1, 2, 5),  # slack (>= 1)
    (1, 4),  # chunk
    (1, 3, 8),  # window
))


@pytest.mark.parametrize("prompt_len,replayed,generated,budget,schedule,slack,chunk,window", GRID)
def test_every_query_an_eviction_reads_was_recorded(prompt_len, replayed, generated, budget, schedule, slack, chunk,
                                                    window):
    missing = missing_queries(prompt_len=prompt_len, replayed=replayed, generated=min(generated, 20),
                              budget=budget, schedule=schedule, slack=slack, chunk=chunk, window=window)
    assert not missing, f"evictions read unrecorded queries (eviction end, position): {missing[:5]}"


def test_the_line_is_budget_plus_slack_minus_window():
    fixed = EvictionConfig.from_mapping({"policy": "snapkv", "budget": 256, "slack": 16})
    assert queries_needed_above(fixed, page_size=32, window=32) == 256 + 16 - 32
    assert queries_needed_above(EvictionConfig.from_mapping({"policy": "snapkv", "budget": 256}),
                                page_size=32, window=32) == 256  # default slack: one page
    elastic = EvictionConfig.from_mapping({"policy": "snapkv", "budget": 256, "mode": "elastic"})
    assert queries_needed_above(elastic, page_size=32, window=32) == -1  # compressed at any step
    assert queries_needed_above(None, page_size=32, window=32) == NEVER_RECORD
    assert queries_needed_above(fixed, page_size=32, window=0) == NEVER_RECORD


def test_a_line_one_token_higher_would_miss_queries():
    # The rule is tight: recording one decode step later loses a query some eviction reads.
    def with_offset(offset: int) -> list:
        import vllm_evict.schedule as schedule

        original = schedule.queries_needed_above
        try:
            globals()["queries_needed_above"] = lambda *a, **k: original(*a, **k) + offset
            return missing_queries(prompt_len=3, replayed=0, generated=12, budget=4, schedule="chunked", slack=2,
                                   chunk=4, window=3)
        finally:
            globals()["queries_needed_above"] = original

    assert with_offset(0) == []
    assert with_offset(1) != []
