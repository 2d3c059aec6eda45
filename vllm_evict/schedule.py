"""When eviction runs and how many tokens survive: one rule shared by the scheduler, the worker and
the HF reference runner, so that all three agree on every request's physical length."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_evict.policies.base import Phase

if TYPE_CHECKING:
    from vllm_evict.config import EvictionConfig

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


NEVER_RECORD = 2**62  # a physical length no request reaches


def queries_needed_above(config: "EvictionConfig | None", *, page_size: int, window: int) -> int:
    """Physical length after a decode step above which the worker must record that step's queries in
    the observation-window ring (``window`` entries per request); below it they would be overwritten
    before any eviction reads them.

    A fixed-mode request evicts while decoding only when it reaches budget + slack (``eviction_target``),
    and the last ``window`` queries of that step come from steps that left more than budget + slack -
    window tokens: the length grows by at most one token per query, and an eviction inside the window
    (possible only when slack < window) drops it to budget, which is above that line. Elastic requests can be compressed at
    any step (-1: always record); requests without eviction or without a window never."""
    if config is None or window <= 0:
        return NEVER_RECORD
    if config.elastic:
        return -1
    return config.budget + config.slack_for(page_size) - window


def physical_bound(*, prompt_len: int, max_new_tokens: int, budget: int | None, schedule: str | None,
                   slack: int, chunk: int, replayed: int = 0) -> int:
    """Most tokens a request holds in cache at once (``budget`` None: eviction off for it).

    The request computes ``prompt_len`` prompt tokens in steps of at most ``chunk`` tokens, then
    ``replayed`` output tokens the same way (a request resumed after preemption recomputes the
    outputs it had), then generates the rest of ``max_new_tokens`` one token per step. A step holds
    the tokens cached before it plus the ones it computes; eviction (``eviction_target``) runs after.

    This one bound sizes admission (``replayed`` = outputs so far, ``max_new_tokens`` = the same:
    what vLLM reserves is the tokens the request has now), the front end's never-fits check and the
    start-up memory check. It never exceeds ``prompt_len + max_new_tokens``, which is what the
    request holds without eviction.
    """
    total = prompt_len + max_new_tokens
    if budget is None:
        return total
    computed_in_chunks = prompt_len + replayed
    # A prompt step starts from at most ``budget`` cached tokens (chunked) or the prompt so far
    # (one-shot evicts only after the step that completes the prompt).
    start = budget if schedule == "chunked" else prompt_len - 1
    peak = min(computed_in_chunks, start + chunk)
    # Decode steps start from at most budget + slack - 1 tokens (eviction_target evicts at budget + slack).
    decode_start = budget + slack - 1
    if replayed > 0:
        peak = max(peak, min(computed_in_chunks, decode_start + chunk))
        cached = min(computed_in_chunks, decode_start)
    else:
        cached = min(prompt_len, budget)  # the step that completes the prompt evicts down to the budget
    if total > computed_in_chunks:  # then one token per step, evicted back at budget + slack
        peak = max(peak, min(cached + total - computed_in_chunks, budget + slack))
    return peak


def longest_request_bound(*, max_model_len: int, budget: int, schedule: str, slack: int, chunk: int) -> int:
    """``physical_bound`` of the worst request of ``max_model_len`` tokens: the whole prompt held at
    once (one-shot), or every token computed in chunks (a long request resumed after preemption)."""
    shapes = [(max_model_len, 0, 0), (1, max_model_len - 1, max_model_len - 1)]
    return max(physical_bound(prompt_len=p, max_new_tokens=n, replayed=r, budget=budget, schedule=schedule,
                              slack=slack, chunk=chunk) for p, n, r in shapes)


def _bound_schedule(config: "EvictionConfig") -> str:
    # Elastic requests are compressed during chunked prefill when the pool runs short, so they are
    # bounded like the chunked schedule.
    return "chunked" if config.elastic else config.schedule


def request_bound(config: "EvictionConfig | None", *, prompt_len: int, max_new_tokens: int, page_size: int,
                  chunk: int, replayed: int = 0) -> int:
    """``physical_bound`` of a request under ``config`` (None: eviction off for it): the one place that
    turns a config into the bound's arguments, for admission, the never-fits check and start-up."""
    if config is None:
        return prompt_len + max_new_tokens
    return physical_bound(prompt_len=prompt_len, max_new_tokens=max_new_tokens, replayed=replayed,
                          budget=config.budget, schedule=_bound_schedule(config),
                          slack=config.slack_for(page_size), chunk=chunk)


def longest_bound(config: "EvictionConfig", *, max_model_len: int, page_size: int, chunk: int) -> int:
    """``longest_request_bound`` under ``config``: what the start-up memory check must fit."""
    return longest_request_bound(max_model_len=max_model_len, budget=config.budget,
                                 schedule=_bound_schedule(config), slack=config.slack_for(page_size), chunk=chunk)
