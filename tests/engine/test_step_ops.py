"""The per-step path's cost does not grow with the batch: on a decode step where no request evicts,
the operations the hooks dispatch per layer, and those the step builder dispatches once per step, are
the same at batch 1 and at batch 16, and none of them waits for the device.

Counted with a TorchDispatchMode around the real engine's hook and builder (tiny random Llama, CPU)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.engine.helpers import greedy, token_prompt

pytestmark = pytest.mark.engine

# aten ops that read a device value back to the host (a synchronisation on a GPU).
SYNCS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero", "any", "all"}
# Metadata-only ops (no device kernel); PyTorch's indexing adds or drops some of them for a single
# index element, so they are left out of the comparison.
VIEWS = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze", "transpose",
         "permute", "t", "alias", "detach", "lift_fresh", "reshape", "unbind"}


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def decode_step_counts(engine: Any, batch: int) -> tuple[Counter, Counter]:
    """Ops of one hooked layer and of the builder, on a decode step of ``batch`` requests that evicts nothing."""
    runner = engine.runner
    per_layer: list[tuple[int, Counter]] = []
    per_step: list[tuple[int, Counter]] = []
    original_layer, original_build = runner._evict_layer, runner.evict_builder.build

    def counted_layer(index, layer, step, *args):
        with OpCounter() as counter:
            original_layer(index, layer, step, *args)
        per_layer.append((step.num_tokens, counter.ops))

    def counted_build(runner_, plan, num_scheduled):
        with OpCounter() as counter:
            built = original_build(runner_, plan, num_scheduled)
        per_step.append((built.num_tokens, counter.ops))
        return built

    runner._evict_layer, runner.evict_builder.build = counted_layer, counted_build
    try:
        prompts = [token_prompt(20, offset=i) for i in range(batch)]
        engine.llm.generate(prompts, greedy(6))
    finally:
        runner._evict_layer, runner.evict_builder.build = original_layer, original_build
    # Decode steps of the whole batch: one token per request (the batch reaches them together).
    layer_counts = [ops for tokens, ops in per_layer if tokens == batch]
    step_counts = [ops for tokens, ops in per_step if tokens == batch]
    assert step_counts, "no decode step of the whole batch was seen"
    if not layer_counts:  # the hooks had no work on these steps: they did not even call the layer's step
        layer_counts = [Counter()]
    assert all(c == layer_counts[0] for c in layer_counts), "per-layer ops differ between decode steps"
    return layer_counts[-1], step_counts[-1]


@pytest.mark.parametrize("spec", ["snapkv", "keydiff", "h2o", "criticalkv+snapkv", "ahakv"])
def test_ops_per_layer_do_not_grow_with_the_batch(tiny_llama, engine_factory, spec):
    # A budget above every length: the policy runs (records, and H2O/AhaKV update every step) but never evicts.
    engine = engine_factory(tiny_llama, {"policy": spec, "budget": 1024}, max_num_seqs=16, max_num_batched_tokens=512)
    layer_1, step_1 = decode_step_counts(engine, 1)
    layer_16, step_16 = decode_step_counts(engine, 16)
    assert layer_1 == layer_16, f"{spec}: ops per layer grow with the batch: {layer_1} vs {layer_16}"
    assert step_1 == step_16, f"{spec}: ops per step grow with the batch: {step_1} vs {step_16}"
    assert not SYNCS & (set(layer_16) | set(step_16)), f"{spec}: a host-device sync on the per-step path"
    if spec in ("snapkv", "keydiff"):
        # Far from any eviction nothing is recorded: no query of these steps belongs to the window of an
        # eviction (schedule.window_end), so the hook does nothing.
        assert sum(layer_16.values()) == 0, f"{spec}: {layer_16}"


def test_rows_near_an_eviction_accumulate_their_window_batched(tiny_llama, engine_factory, monkeypatch):
    # Budget 20 + slack 8 - window 16: decode steps that leave more than 12 tokens are in the window of the
    # eviction at 28 tokens (the prompts have 20), and none reaches 28, so nothing is evicted. With window
    # pages off, their queries' attention is added to the window-mass state, batched over the rows.
    monkeypatch.setenv("VLLM_EVICT_WINDOW_PAGES", "0")
    config = {"policy": "snapkv", "budget": 20, "window": 16, "slack": 8}
    engine = engine_factory(tiny_llama, config, max_num_seqs=16, max_num_batched_tokens=512)
    layer_1, step_1 = decode_step_counts(engine, 1)
    layer_16, step_16 = decode_step_counts(engine, 16)
    assert layer_1 == layer_16 and step_1 == step_16, f"ops grow with the batch: {layer_1} vs {layer_16}"
    assert layer_16["softmax"] == 1 and layer_16["index_put_"] == 1, f"one window update per layer: {layer_16}"
    assert "index_copy_" not in layer_16, f"a fixed-mode request keeps no queries: {layer_16}"
    assert engine.runner.evict_buffers.ring is None and engine.scheduler.window_pages.loans == 0


def test_with_window_pages_rows_near_an_eviction_only_store_their_queries(tiny_llama, engine_factory):
    # The same steps by default: the scheduler lends each request a page of the pool for its window, and
    # each layer writes the batch's queries there and computes nothing; the window's mass is computed once,
    # when the eviction reads it. Where the layout's slots are rows of the KV storage (every strided layout,
    # this one too), a write is the queries' rows (one add), one gather and one scatter; through the K/V
    # views (AMX's packed tiles) a gather and a scatter for the slots in K halves, the same for V halves.
    config = {"policy": "snapkv", "budget": 20, "window": 16, "slack": 8}
    engine = engine_factory(tiny_llama, config, max_num_seqs=16, max_num_batched_tokens=512)
    layer_1, step_1 = decode_step_counts(engine, 1)
    layer_16, step_16 = decode_step_counts(engine, 16)
    assert layer_1 == layer_16 and step_1 == step_16, f"ops grow with the batch: {layer_1} vs {layer_16}"
    as_rows = engine.runner.evict_builder.slot_rows is not None
    assert as_rows == (engine.runner.evict_layout != "amx_packed"), engine.runner.evict_layout
    expected = {"add": 1, "index_select": 1, "index_copy_": 1} if as_rows else {"index": 2, "index_put_": 2}
    assert layer_16 == expected, f"the window writes per layer and nothing else: {layer_16}"
    assert not SYNCS & set(step_16), f"a host-device sync on the per-step path: {step_16}"
    assert engine.runner.evict_buffers.ring is None and engine.scheduler.window_pages.loans >= 17


def test_the_step_timer_runs_only_on_layers_with_work(tiny_llama, engine_factory):
    """The step timer (two CUDA events per timed layer on a GPU) brackets a layer's hook only when it has
    work: decode steps far from any eviction time nothing."""
    engine = engine_factory(tiny_llama, {"policy": "snapkv", "budget": 1024}, max_num_seqs=4)
    runner = engine.runner
    timer, build = runner.evict_timer, runner.evict_builder.build
    timed, work = [], []

    class Counting:
        def __enter__(self):
            timed.append(runner.evict_step.layer_work)
            return timer.__enter__()

        def __exit__(self, *exc):
            return timer.__exit__(*exc)

        def take(self):
            return timer.take()

    def recording(*args):
        built = build(*args)
        work.append(built is not None and built.layer_work)
        return built

    runner.evict_timer, runner.evict_builder.build = Counting(), recording
    engine.llm.generate([token_prompt(20)], greedy(6))
    layers = len(runner.evict_layers)
    assert work.count(False) >= 4, f"expected decode steps without work: {work}"
    assert all(timed) and len(timed) == layers * work.count(True), (timed, work)


def prompt_end_step_counts(engine: Any, params: list) -> tuple[Counter, Counter, int]:
    """Ops of one hooked layer and of the builder on the step that completes every prompt of the batch (all
    of them evict there), and the number of groups that step scored."""
    runner = engine.runner
    seen: list[tuple[int, Counter, Counter, int]] = []
    original_layer, original_build = runner._evict_layer, runner.evict_builder.build
    current: dict[str, Any] = {}

    def counted_build(runner_, plan, num_scheduled):
        with OpCounter() as counter:
            built = original_build(runner_, plan, num_scheduled)
        configs = len(set(runner.evict_rows.policy[runner.evict_view.rows].tolist()))
        current.update(tokens=built.num_tokens, build=counter.ops, groups=len(built.plan.groups), layers=[],
                       configs=configs)
        seen.append(current.copy())
        return built

    def counted_layer(index, layer, step, *args):
        with OpCounter() as counter:
            original_layer(index, layer, step, *args)
        seen[-1]["layers"].append(counter.ops)

    runner._evict_layer, runner.evict_builder.build = counted_layer, counted_build
    try:
        engine.llm.generate([token_prompt(100, offset=i) for i in range(len(params))], params)
    finally:
        runner._evict_layer, runner.evict_builder.build = original_layer, original_build
    (step,) = [s for s in seen if s["tokens"] == 100 * len(params)]  # the whole batch's prompts in one step
    assert all(c == step["layers"][0] for c in step["layers"]), "per-layer ops differ between layers"
    return step["layers"][0], step["build"], step["groups"], step["configs"]


def test_requests_of_one_method_share_a_group_whatever_their_numbers(tiny_llama, engine_factory):
    """32 requests with 32 seeds, 32 budgets and 4 windows are scored in one call per layer, with the same
    operations as 32 identical requests: the work per layer follows the methods in use, not the configs."""
    server = {"policy": "snapkv", "budget": 64, "window": 16}
    engine = engine_factory(tiny_llama, server, max_num_seqs=32, max_num_batched_tokens=3200, pages=2048)
    same = prompt_end_step_counts(engine, [greedy(2)] * 32)
    varied = prompt_end_step_counts(engine, [greedy(2, kv_budget=40 + i, kv_eviction_config=json.dumps(
        {"seed": 1000 + i, "window": (8, 12, 16, 20)[i % 4]})) for i in range(32)])
    assert (same[3], varied[3]) == (1, 32)  # one config, then 32 configs in the step
    assert same[2] == varied[2] == 1, (same[2], varied[2])
    assert varied[0] == same[0], f"ops per layer differ: {varied[0]} vs {same[0]}"
    assert varied[1] == same[1], f"ops of the step builder differ: {varied[1]} vs {same[1]}"
