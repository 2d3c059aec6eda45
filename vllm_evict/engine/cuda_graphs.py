"""Full CUDA graphs on the steps where no attention layer has eviction work.

Eviction's per-layer hook (engine/runner.py ``forward_then_evict``) is Python after each layer's
attention. A full CUDA graph replays the whole forward, attention included, without running any Python,
so a step may replay one only when the hook would do nothing in it: no request records window queries,
computes a per-token state, evicts or copies a shared page. The scheduler says which steps those are
(``EvictionPlan.layer_work``, from ``schedule.works_in_layers``: it may say yes early, never late, and the
workers check it against the step they build); the runner sets ``evict_layer_step`` from it at the start of
each step, before vLLM picks the step's graph, and the wrappers here keep FULL out of that pick:

- the V1 runner picks through ``cudagraph_dispatcher.dispatch(..., invalid_modes=...)`` (vLLM's own
  way to keep a batch out of full graphs, used for encoder outputs): FULL joins ``invalid_modes``;
- Model Runner V2 picks through ``cudagraph_manager.dispatch``, which finds the first compatible graph
  in a priority list: asked without a uniform token count and a query-length bound, it can only match
  graphs that take any batch, i.e. PIECEWISE under FULL_AND_PIECEWISE (nothing, so eager, under
  FULL_DECODE_ONLY). vLLM's FULL mode, whose mixed graphs are full too, is refused in guards.py.

Captured graphs never contain eviction work: capture runs outside a scheduled step (the hook sees no
step). A full graph reads the lengths and slot mapping from the buffers it was captured with; V1 makes
them physical in those buffers already (engine/runner_v1.py), V2 keeps its batch's ``seq_lens`` logical
for the sampler, so around a full-graph replay the physical lengths are put into vLLM's buffer and the
logical ones back after it (``V2View.physical_lengths``), both queued on the stream, no sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

HOOK_ATTR = "__vllm_evict_full_graph_guard__"  # set on an installed wrapper: the method it wraps


def _modes() -> Any:
    from vllm.config.compilation import CUDAGraphMode

    return CUDAGraphMode


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(method, HOOK_ATTR, method)  # never wrap a wrapper (vLLM may re-initialize its cache)


def guard_v1_dispatcher(runner: Any) -> bool:
    """Keep FULL out of the V1 runner's dispatch on steps with layer work. False: the runner has no
    dispatcher (nothing to guard)."""
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    if dispatcher is None:
        return False
    original = _unwrapped(dispatcher.dispatch)
    full = _modes().FULL

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if runner.evict_layer_step:
            kwargs["invalid_modes"] = {*(kwargs.get("invalid_modes") or ()), full}
        return original(*args, **kwargs)

    setattr(dispatch, HOOK_ATTR, original)
    dispatcher.dispatch = dispatch
    return True


def guard_v2_manager(runner: Any) -> bool:
    """Keep FULL out of Model Runner V2's dispatch on steps with layer work, and give a full-graph
    replay the physical lengths. False: the runner has no graph manager."""
    manager = getattr(runner, "cudagraph_manager", None)
    if manager is None:
        return False
    original = _unwrapped(manager.dispatch)
    modes = _modes()
    full = modes.FULL

    def dispatch(num_reqs: int, num_tokens: int, uniform_token_count: int | None, num_active_loras: int,
                 max_query_len: int | None = None, num_ubatches: int = 1) -> Any:
        if not runner.evict_layer_step:
            return original(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                            max_query_len=max_query_len, num_ubatches=num_ubatches)
        desc = original(num_reqs, num_tokens, None, num_active_loras, max_query_len=None,
                        num_ubatches=num_ubatches)
        if desc.cg_mode == full:  # only a mode whose mixed graphs are full (refused at start-up): eager
            desc = dataclasses.replace(desc, cg_mode=modes.NONE, num_tokens=num_tokens, num_reqs=num_reqs,
                                       uniform_token_count=None, max_query_len=None)
        return desc

    setattr(dispatch, HOOK_ATTR, original)
    manager.dispatch = dispatch
    replay = getattr(manager, "run_fullgraph", None)
    if replay is not None:
        original_replay = _unwrapped(replay)
        view = runner.evict_view

        def run_fullgraph(desc: Any, *args: Any, **kwargs: Any) -> Any:
            with view.physical_lengths():
                return original_replay(desc, *args, **kwargs)

        setattr(run_fullgraph, HOOK_ATTR, original_replay)
        manager.run_fullgraph = run_fullgraph
    return True
