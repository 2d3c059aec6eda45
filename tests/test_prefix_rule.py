"""``schedule.changes_cached_tokens`` (when prefix caching stops sharing a request's pages) is never late:
at every step of a request where the workers' own rules (``eviction_target``, ``window_end``,
``WindowEnd.recorded``, as ``StepBuilder`` applies them) write into its cache, it says so."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from vllm_evict.config import EvictionConfig
from vllm_evict.schedule import (changes_cached_tokens, eviction_target, phase_of, window_end, window_start,
                                  works_in_layers)

PAGE = 16
SPECS = ["snapkv", "tova", "keydiff", "nacl", "streamingllm", "knorm", "random", "caote+snapkv",
         "criticalkv+snapkv", "h2o", "ahakv"]


def workers_write(policy, config, *, tokens_before: int, num_new: int, prompt_len: int, phys_before: int) -> bool:
    """What the step builder decides for one row: it acts on (writes into) the row's cache."""
    phys_after = phys_before + num_new
    phase = phase_of(tokens_before, num_new, prompt_len)
    slack = config.slack_for(PAGE)
    keep = eviction_target(phys_after=phys_after, phase=phase, budget=config.budget, schedule=config.schedule,
                           slack=slack)
    if keep is not None or policy.needs_every_step:
        return True
    if not policy.accumulates_window:
        return False
    one = np.ones(1, dtype=np.int64)
    end = window_end(cached_after=one * phys_after, scheduled=one * num_new, logical_after=one * (tokens_before + num_new),
                     prompt=one * prompt_len, evicting=np.zeros(1, dtype=bool), budget=one * config.budget,
                     slack=one * slack, one_shot=np.full(1, config.schedule == "oneshot"),
                     at_prompt_end=np.full(1, policy.window_at_prompt_end),
                     in_decode=np.full(1, policy.window_in_decode))
    width = policy.window_size(end.logical, end.kept)
    return bool(end.now[0] or end.recorded(one * phys_after, one * num_new, width)[0] > 0)


def cases(spec: str) -> list[tuple[EvictionConfig, Any, int, int]]:
    """(config, its policy, prompt length, prefill chunk) over budgets, prompts, chunks and schedules."""
    out = []
    for budget, prompt_len, chunk, schedule in itertools.product((64, 200), (40, 130, 500), (16, 48, 512),
                                                                 ("chunked", "oneshot")):
        config = EvictionConfig.from_spec(spec, budget, schedule=schedule)
        out.append((config, config.build_policy(), prompt_len, chunk))
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_never_late(spec: str) -> None:
    steps = said_early = 0
    for config, policy, prompt_len, chunk in cases(spec):
        tokens, phys = 0, 0
        while tokens < prompt_len + 300:  # the prompt in chunks, then decode, until the first write
            num_new = min(chunk, prompt_len - tokens) if tokens < prompt_len else 1
            exact = workers_write(policy, config, tokens_before=tokens, num_new=num_new, prompt_len=prompt_len,
                                  phys_before=phys)
            said = changes_cached_tokens(policy, config, tokens_before=tokens, num_new=num_new,
                                         prompt_len=prompt_len, phys_before=phys, page_size=PAGE)
            assert said or not exact, (config, prompt_len, chunk, tokens)
            steps += 1
            said_early += said and not exact
            if exact:
                break  # the request is private from here on
            tokens, phys = tokens + num_new, phys + num_new
    assert steps >= 36  # every case ran (H2O and AhaKV write from their first step)
    # Early only by the width of a window (its bound, not the step's exact one): most steps are not.
    assert said_early <= steps // 4, (said_early, steps)


@pytest.mark.parametrize("spec", SPECS)
def test_layer_work_is_never_missed_over_a_whole_request(spec: str) -> None:
    """``schedule.works_in_layers`` (a step without it may replay a full CUDA graph, engine/cuda_graphs.py):
    through a request's whole life, evictions included, it says yes at every step the workers' rules act on
    the row or compute a per-token state, and it is exact there for the methods without such a state."""
    steps = early = 0
    for config, policy, prompt_len, chunk in cases(spec):
        tokens, phys = 0, 0
        while tokens < prompt_len + 150:
            num_new = min(chunk, prompt_len - tokens) if tokens < prompt_len else 1
            kwargs = dict(tokens_before=tokens, num_new=num_new, prompt_len=prompt_len, phys_before=phys)
            work = bool(policy.computed_state) or workers_write(policy, config, **kwargs)
            said = works_in_layers(policy, config, page_size=PAGE, **kwargs)
            assert said or not work, (config, prompt_len, chunk, tokens, phys)
            steps += 1
            early += said and not work
            keep = eviction_target(phys_after=phys + num_new, phase=phase_of(tokens, num_new, prompt_len),
                                   budget=config.budget, schedule=config.schedule, slack=config.slack_for(PAGE))
            tokens, phys = tokens + num_new, keep if keep is not None else phys + num_new
    assert steps >= 5000
    assert early <= steps // 10, (early, steps)


def window_queries(policy, config, *, tokens_before: int, num_new: int, prompt_len: int) -> int:
    """Queries of a prompt step (nothing evicted before it) that the workers add to a window read later, not
    in this step by an eviction of its own (those are the step's own queries, always computed)."""
    phase = phase_of(tokens_before, num_new, prompt_len)
    slack = config.slack_for(PAGE)
    after = tokens_before + num_new
    if eviction_target(phys_after=after, phase=phase, budget=config.budget, schedule=config.schedule,
                       slack=slack) is not None:
        return 0
    if not policy.accumulates_window:
        return 0
    one = np.ones(1, dtype=np.int64)
    end = window_end(cached_after=one * after, scheduled=one * num_new, logical_after=one * after,
                     prompt=one * prompt_len, evicting=np.zeros(1, dtype=bool), budget=one * config.budget,
                     slack=one * slack, one_shot=np.full(1, config.schedule == "oneshot"),
                     at_prompt_end=np.full(1, policy.window_at_prompt_end),
                     in_decode=np.full(1, policy.window_in_decode))
    return int(end.recorded(one * after, one * num_new, policy.window_size(end.logical, end.kept))[0])


@pytest.mark.parametrize("spec", SPECS)
def test_a_prefix_hit_stops_before_every_query_a_window_reads(spec: str) -> None:
    """``schedule.window_start`` (where a prefix-cache hit stops: vLLM does not recompute a cached token's
    query): no prompt query before it joins a window the workers read later, and for the one-shot methods
    with a window it is exact to within the widest window."""
    recorded = 0
    for config, policy, prompt_len, _ in cases(spec):
        start = window_start(policy, config, prompt_len=prompt_len, page_size=PAGE)
        if policy.needs_every_step:
            assert start is None  # private from the start: it reads no cached prefix at all
            continue
        for position in range(prompt_len):
            if window_queries(policy, config, tokens_before=position, num_new=1, prompt_len=prompt_len):
                recorded += 1
                assert start is not None and position >= start, (config, prompt_len, position, start)
        if start is not None and config.schedule == "oneshot" and prompt_len > config.budget:
            assert prompt_len - start <= policy.window_for(config.budget)
    if spec in ("snapkv", "nacl", "caote+snapkv", "criticalkv+snapkv"):  # TOVA's one query is the evicting step's
        assert recorded > 0
