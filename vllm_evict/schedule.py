"""When eviction runs and how many tokens survive: one rule shared by the scheduler, the worker and
the HF reference runner, so that all three agree on every request's physical length."""

from __future__ import annotations

from vllm_evict.policies.base import Phase

SCHEDULES = ("chunked", "oneshot")


def phase_of(tokens_before: int, num_new: int, prompt_len: int) -> Phase:
    """Phase of a step that appends ``num_new`` tokens to ``tokens_before`` logical tokens."""
    if tokens_before >= prompt_len:
        return Phase.DECODE
    if tokens_before + num_new >= prompt_len:
        return Phase.PROMPT_END
    return Phase.PREFILL


def eviction_target(*, phys_after: int, phase: Phase, budget: int, schedule: str, slack: int) -> int | None:
    """Tokens to keep after a step that leaves ``phys_after`` tokens in cache, or None for no eviction.

    - chunked schedule: after every prompt chunk that leaves more than ``budget`` tokens, so a
      request never holds more than budget + one chunk;
    - one-shot schedule: once, after the chunk that completes the prompt;
    - decode (both schedules): when the cache has grown to budget + slack, back to budget, so a
      request never holds more than budget + slack while generating.
    """
    if phase is Phase.DECODE:
        return budget if phys_after >= budget + slack and phys_after > budget else None
    if schedule == "chunked" or phase is Phase.PROMPT_END:
        return budget if phys_after > budget else None
    return None


def physical_bound(*, prompt_len: int, max_new_tokens: int, budget: int | None, schedule: str | None,
                   slack: int, chunk: int) -> int:
    """Most tokens a request will ever hold in cache (``budget`` None: eviction off for it)."""
    total = prompt_len + max_new_tokens
    if budget is None:
        return total
    decode = budget + slack
    if schedule == "oneshot":
        return min(total, max(prompt_len, decode))
    return min(total, max(budget + chunk, decode))
