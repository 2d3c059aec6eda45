"""What eviction does to one request running alone, step by step, from the shared rule only
(``vllm_evict.schedule``) and vLLM's paging: the expected per-request stats and metric increments that
the engine and server tests compare against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_evict.config import EvictionConfig
from vllm_evict.schedule import eviction_target, phase_of, window_end
from vllm_evict.stats import POLICY_NONE, RequestEvictionStats


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


@dataclass(frozen=True)
class Expected:
    stats: RequestEvictionStats
    steps: int  # engine steps the request is scheduled in (prefill chunks + decode steps)
    eviction_steps: int  # steps in which it evicted
    work_steps: int  # steps with eviction work per layer (the step timer observes those): see ``has_work``


def expected_run(config: EvictionConfig | None, *, prompt_len: int, max_tokens: int, chunk: int,
                 page: int) -> Expected:
    """A request of ``prompt_len`` tokens generating ``max_tokens`` tokens, alone on the engine: its prompt
    is prefilled in chunks of ``chunk`` tokens, then one token per step; the last sampled token is never
    computed. Pages freed by a compaction go back at the start of the next step, if there is one."""
    sizes = [min(chunk, prompt_len - start) for start in range(0, prompt_len, chunk)] + [1] * (max_tokens - 1)
    logical = phys = peak = evicted = freed = evictions = work = 0
    for index, num_new in enumerate(sizes):
        phys_after = phys + num_new
        peak = max(peak, phys_after)
        keep = None
        if config is not None:
            slack = config.slack_for(page)
            keep = eviction_target(phys_after=phys_after, phase=phase_of(logical, num_new, prompt_len),
                                   budget=config.budget, schedule=config.schedule, slack=slack)
        work += config is not None and has_work(config, phys_after=phys_after, num_new=num_new,
                                                logical_after=logical + num_new, prompt_len=prompt_len,
                                                evicting=keep is not None, page=page)
        logical += num_new
        phys = phys_after if keep is None else keep
        if keep is not None:
            evicted += phys_after - keep
            evictions += 1
            if index + 1 < len(sizes):
                freed += _pages(phys_after, page) - _pages(keep, page)
    stats = RequestEvictionStats(
        policy=config.policy if config else POLICY_NONE, budget=config.budget if config else None,
        tokens_evicted=evicted, tokens_cached=phys, peak_tokens_cached=peak, pages_freed=freed)
    return Expected(stats=stats, steps=len(sizes), eviction_steps=evictions, work_steps=work)


def has_work(config: EvictionConfig, *, phys_after: int, num_new: int, logical_after: int, prompt_len: int,
             evicting: bool, page: int) -> bool:
    """Whether a fixed-mode request alone in a step gives the layers work: it evicts, its policy computes
    a per-token state or updates its state every step, or the step's queries join (or read) its
    accumulated observation window (``schedule.window_end``). Decode steps far from an eviction have none."""
    policy = config.build_policy()
    if evicting or policy.computed_state or policy.needs_every_step:
        return True
    if not policy.accumulates_window:
        return False
    one = lambda value: np.array([value], dtype=np.int64)  # noqa: E731
    end = window_end(cached_after=one(phys_after), scheduled=one(num_new), logical_after=one(logical_after),
                     prompt=one(prompt_len), evicting=np.array([evicting]), budget=one(config.budget),
                     slack=one(config.slack_for(page)), one_shot=np.array([config.schedule == "oneshot"]),
                     at_prompt_end=np.array([policy.window_at_prompt_end]),
                     in_decode=np.array([policy.window_in_decode]))
    recorded = end.recorded(one(phys_after), one(num_new), policy.window_size(end.logical, end.kept))
    return bool(recorded[0] > 0 or end.now[0])
