"""What the scheduler tells the workers each step. Crosses a pickle boundary under the multiprocess
executor, so it holds only plain data, and only for the requests that evict in this step: the
workers know every request's policy from its sampling parameters, and its lengths from vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

# Name of the attribute the scheduler sets on vLLM's SchedulerOutput.
PLAN_ATTR = "kv_eviction_plan"


@dataclass
class EvictionPlan:
    # request id -> tokens kept per (layer, KV head) after this step's attention
    keep: dict[str, int] = field(default_factory=dict)
    # request id -> tokens physically cached after this step's tokens, before eviction: the worker
    # checks its own count against it, so a disagreement stops the step instead of corrupting a cache
    cached: dict[str, int] = field(default_factory=dict)
    # Elastic mode: requests compressed BEFORE this step's forward (engine/elastic.py): request id ->
    # tokens kept, the tokens cached before, and the request's whole page list after the compression
    # (it replaces the new block ids vLLM would send, some of which the request gave back).
    compress: dict[str, int] = field(default_factory=dict)
    compress_cached: dict[str, int] = field(default_factory=dict)
    compress_pages: dict[str, list[int]] = field(default_factory=dict)
    # Window pages (engine/window_lender.py): pages lent in this step to requests inside a decode window,
    # request id -> page ids; and the requests whose loan ended in this step (the workers first add the
    # mass of any window queries the pages hold to the request's window state, before the forward).
    window_pages: dict[str, list[int]] = field(default_factory=dict)
    window_returned: list[str] = field(default_factory=list)
    # Prefix caching (engine/prefix_sharing.py): requests whose hashed or shared pages are replaced in this
    # step, request id -> (original page ids, their copies' ids), copied by the workers after each layer's
    # attention; and the request's whole page list with the copies in place, which the workers' block
    # table takes at the start of the next step (this step's forward reads and writes the originals).
    copies: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    pages: dict[str, list[int]] = field(default_factory=dict)
    # Whether any attention layer has eviction work in this step (``schedule.works_in_layers`` for some
    # request, or copies): a step without runs vLLM's full CUDA graphs (engine/cuda_graphs.py).
    layer_work: bool = True
