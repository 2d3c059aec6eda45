"""What eviction does to one request running alone, step by step, from the shared rule only
(``vllm_evict.schedule``) and vLLM's paging: the expected per-request stats and metric increments that
the engine and server tests compare against."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_evict.config import EvictionConfig
from vllm_evict.schedule import eviction_target, phase_of
from vllm_evict.stats import POLICY_NONE, RequestEvictionStats


def _pages(tokens: int, page: int) -> int:
    return -(-tokens // page)


@dataclass(frozen=True)
class Expected:
    stats: RequestEvictionStats
    steps: int  # engine steps the request is scheduled in (prefill chunks + decode steps)
    eviction_steps: int  # steps in which it evicted


def expected_run(config: EvictionConfig | None, *, prompt_len: int, max_tokens: int, chunk: int,
                 page: int) -> Expected:
    """A request of ``prompt_len`` tokens generating ``max_tokens`` tokens, alone on the engine: its prompt
    is prefilled in chunks of ``chunk`` tokens, then one token per step; the last sampled token is never
    computed. Pages freed by a compaction go back at the start of the next step, if there is one."""
    sizes = [min(chunk, prompt_len - start) for start in range(0, prompt_len, chunk)] + [1] * (max_tokens - 1)
    logical = phys = peak = evicted = freed = evictions = 0
    for index, num_new in enumerate(sizes):
        phys_after = phys + num_new
        peak = max(peak, phys_after)
        keep = None
        if config is not None:
            slack = config.slack_for(page)
            keep = eviction_target(phys_after=phys_after, phase=phase_of(logical, num_new, prompt_len),
                                   budget=config.budget, schedule=config.schedule, slack=slack)
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
    return Expected(stats=stats, steps=len(sizes), eviction_steps=evictions)
