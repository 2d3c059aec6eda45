"""When eviction runs and how many tokens survive: one rule shared by the scheduler, the worker and
the HF reference runner, so that all three agree on every request's physical length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_evict.policies.base import Phase

if TYPE_CHECKING:
    from vllm_evict.config import EvictionConfig
    from vllm_evict.policies.base import Policy

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


# ---- the observation window ------------------------------------------------------------------------
NO_WINDOW = -1  # ``WindowEnd.length`` of a row whose next window end is not known yet


@dataclass(frozen=True)
class WindowEnd:
    """Where each row's observation window ends next: the physical length ``length`` at which the window
    is read (an eviction, or a prompt end the policy reads its window at), whether an eviction happens
    there (``evicts``), and the row's logical length and tokens kept then (what the policy's
    ``window_size`` / ``window_gain`` are evaluated at). Arrays over rows; ``length`` NO_WINDOW: unknown."""

    length: np.ndarray
    evicts: np.ndarray
    logical: np.ndarray
    kept: np.ndarray
    now: np.ndarray  # the window ends with this step: the step reads it

    def recorded(self, cached_after: np.ndarray, scheduled: np.ndarray, width: np.ndarray) -> np.ndarray:
        """This step's queries that belong to the window (its last ``width`` queries before ``length``):
        each row's last n of them, n returned per row. Physical lengths grow by one per query up to
        the window's end (nothing is evicted in between), so the query that leaves the cache at length p
        is in the window iff p > length - width."""
        first = np.maximum(self.length - width, cached_after - scheduled)
        n = np.clip(cached_after - first, 0, scheduled)
        return np.where(self.length == NO_WINDOW, 0, n)


def window_end(*, cached_after: np.ndarray, scheduled: np.ndarray, logical_after: np.ndarray, prompt: np.ndarray,
               evicting: np.ndarray, budget: np.ndarray, slack: np.ndarray, one_shot: np.ndarray,
               at_prompt_end: np.ndarray, in_decode: np.ndarray) -> WindowEnd:
    """The next window end of every row of a step (fixed mode; arrays over rows), as far as this step
    knows it, from the shared rule ``eviction_target``:

    * a step that evicts (and whose policy reads the window in its phase), or that completes the prompt
      of a policy reading its window there: this step's end;
    * decode, or a prompt that will end without an eviction: the first decode eviction, at budget + slack;
    * one-shot prefill of a prompt longer than the budget: the prompt's end;
    * chunked prefill of a prompt longer than the budget: unknown, since the chunk that evicts next can
      be of any size; its window holds only its own queries (block-wise, as the papers' chunked setting).

    ``evicting``: this step evicts; ``one_shot``, ``at_prompt_end``, ``in_decode``: the row's schedule and
    its policy's ``window_at_prompt_end`` / ``window_in_decode``. Elastic rows keep queries instead."""
    computed = logical_after - scheduled
    decode = computed >= prompt
    completes = ~decode & (logical_after >= prompt)
    prefill = logical_after < prompt
    prompt_end = cached_after + (prompt - logical_after)  # physical length at the prompt's end (no eviction before)
    now = (evicting & (~decode | in_decode)) | (completes & at_prompt_end)
    end_evicts_prompt = prompt_end > budget
    next_decode = budget + slack
    length = np.full(len(cached_after), NO_WINDOW, dtype=np.int64)
    evicts = np.zeros(len(cached_after), dtype=bool)
    # decode, and a prompt that ends (or ended) without an eviction: the first decode eviction
    to_decode = ~now & in_decode & (decode | completes | (prefill & ~end_evicts_prompt & ~at_prompt_end))
    length[to_decode], evicts[to_decode] = next_decode[to_decode], True
    # one-shot prefill (an eviction at the prompt's end), or a policy reading its window at the prompt end
    # when nothing is evicted before it
    to_prompt_end = ~now & prefill & ((one_shot & (end_evicts_prompt | at_prompt_end))
                                      | (~one_shot & ~end_evicts_prompt & at_prompt_end))
    length[to_prompt_end], evicts[to_prompt_end] = prompt_end[to_prompt_end], end_evicts_prompt[to_prompt_end]
    length[now], evicts[now] = cached_after[now], evicting[now]
    logical = logical_after + (length - cached_after)
    kept = np.where(evicts, budget, length)
    return WindowEnd(length=length, evicts=evicts, logical=logical, kept=kept, now=now)


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


# ---- prefix caching: the first step that changes a request's cached tokens --------------------------
def changes_cached_tokens(policy: "Policy", config: "EvictionConfig", *, tokens_before: int, num_new: int,
                          prompt_len: int, phys_before: int, page_size: int) -> bool:
    """Whether the workers may write, in this step, into slots the request filled in earlier steps, or
    into this step's own slots after the attention wrote them: an eviction (compaction, and the window's
    reset), or a window query adding its mass to every cached token's state; a policy that updates every
    token's state at every step, and elastic mode, always. Prefix caching shares a request's pages only
    until this is true (engine/prefix_sharing.py). It may say so early (an earlier private copy), never
    late: O(1) scalar bounds of ``eviction_target`` and ``window_end`` with the widest window
    (``Policy.window_for``), run per scheduled request while it shares."""
    if config.elastic or policy.needs_every_step:
        return True
    phys_after = phys_before + num_new
    phase = phase_of(tokens_before, num_new, prompt_len)
    slack = config.slack_for(page_size)
    if eviction_target(phys_after=phys_after, phase=phase, budget=config.budget, schedule=config.schedule,
                       slack=slack) is not None:
        return True
    if not policy.accumulates_window:
        return False
    if phase is Phase.DECODE:
        decode_end = config.budget + slack  # the first decode eviction, where a decode window ends
        return policy.window_in_decode and phys_after > decode_end - policy.window_for(config.budget)
    # A prompt step (nothing evicted before it, so physical = logical). A chunked prompt's evictions read
    # only their own step's queries (above).
    start = window_start(policy, config, prompt_len=prompt_len, page_size=page_size)
    return start is not None and phys_after > start


def window_start(policy: "Policy", config: "EvictionConfig", *, prompt_len: int, page_size: int) -> int | None:
    """The first prompt position whose query joins a window read after the prompt: one that ends at the
    prompt's end (a one-shot eviction there, or a policy reading its window there) or, when the prompt
    ends without an eviction, at the first decode eviction; None when no such window reads a prompt
    query. Every query from here on must be computed by the request itself, so a prefix-cache hit stops
    before it (``EvictKVCacheManagerMixin.get_computed_blocks``): a cached token's query is never
    recomputed. The widest window (``Policy.window_for``), so it may start early, never late."""
    if config.elastic or policy.needs_every_step or not policy.accumulates_window:
        return None
    width = policy.window_for(config.budget)
    ends = []
    if policy.window_at_prompt_end or (config.schedule == "oneshot" and prompt_len > config.budget):
        ends.append(prompt_len)
    if prompt_len <= config.budget and policy.window_in_decode:
        ends.append(config.budget + config.slack_for(page_size))  # the first decode eviction
    return max(min(ends) - width, 0) if ends else None


# ---- full CUDA graphs: the steps whose attention layers run eviction's per-layer work ---------------
def works_in_layers(policy: "Policy", config: "EvictionConfig", *, tokens_before: int, num_new: int,
                    prompt_len: int, phys_before: int, page_size: int) -> bool:
    """Whether the workers' per-layer hook may have work for this request in this step: compute a
    per-token state for the new tokens (``Policy.computed_state``), record window queries, add a
    window's mass, evict, or keep the elastic ring (``changes_cached_tokens``). A step where this is
    false for every request (and no shared page is copied) runs vLLM's full CUDA graphs, which replay
    attention without the hook, so it may say yes early, never late: the workers check each step
    (engine/runner.py ``_build_step``)."""
    return bool(policy.computed_state) or changes_cached_tokens(
        policy, config, tokens_before=tokens_before, num_new=num_new, prompt_len=prompt_len,
        phys_before=phys_before, page_size=page_size)
