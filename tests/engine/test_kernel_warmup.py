"""The start-up warm-up (vllm_evict/engine/warmup.py) launches every Triton kernel variant that serving
then needs, and serving never needs a second variant of a kernel for a per-step number.

The real engine (tiny random Llama, CPU) runs its eviction operations on the Triton kernels
(``ops.use_backend("triton")``); every launch is recorded, not run, with its compile-time
identity (``vllm_evict.kernels.variants.variant_key``: constexprs, dtypes, pointer alignment, the
value class of each specialised integer, as Triton keys its compiled variants). The warm-up is run on
the engine's own layer, then a batch of every method, with options other than the warm-up's (smaller
windows) and other budgets, evicts in prefill, at the prompt's end and while decoding."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from tests.engine.helpers import greedy, token_prompt
from vllm_evict import ops
from vllm_evict.engine.warmup import warmup_configs
from vllm_evict.kernels._common import unspecialised
from vllm_evict.kernels.variants import LaunchRecorder, kernel_name

pytestmark = pytest.mark.engine

# Every method is reserved for requests, as the warm-up compiles all of them.
SERVER = {"policy": "snapkv", "budget": 64, "window": 8,
          "request_policies": sorted({config.policy for config in warmup_configs()})}
SMALL = {"snapkv": {"window": 8}, "ahakv": {"recent": 8}, "nacl": {"proxy": 8}}


def batch() -> tuple[list, list]:
    prompts, params = [], []
    for i, config in enumerate(warmup_configs()):
        base = config.policy.split("+")[-1]
        options = {**dict(config.options), **SMALL.get(base, {})}
        extra = {"kv_eviction": config.policy, "kv_budget": 40 + 8 * (i % 3), "kv_eviction_config": json.dumps(options)}
        prompts.append(token_prompt(60 + 5 * i, offset=i + 1))
        params.append(greedy(36, **extra))
    return prompts, params


# Decode windows wait in lent pages (the default); windows in prefill accumulate their mass as their
# queries arrive (ops.accumulate_window_mass), the kernel decode windows run with lending off, so one
# server covers both. The eviction step is the same code on both runners: the suite runs this test on
# V1 only (the Makefile's V2_TESTS).
def test_warm_up_compiles_every_variant_serving_launches(tiny_llama, engine_factory):
    engine = engine_factory(tiny_llama, SERVER, max_num_seqs=32, max_num_batched_tokens=192, pages=1024)
    runner = engine.runner
    # The warm-up's kernels write only scratch (rows in the null page, scratch positions and states) and
    # its launches do not depend on what they compute, so they are recorded, not run: running them in the
    # interpreter took half of this test's five minutes on CPU.
    with ops.use_backend("triton"), LaunchRecorder(execute=False) as warm:
        runner.evict_warm_up()
    # Serving's launches are recorded without running too: on the eviction path every launch argument
    # comes from the host's schedule (lengths, budgets, pages), never from what a kernel computed, so the
    # variants are the same either way (checked on 2026-11-28: the same 19 variants and launch count with
    # and without running them, 183 s against 24 s). That the kernels compute the reference's scores on
    # the engine's paged layout is tests/kernels/test_policy_kernels.py's job.
    prompts, params = batch()
    with ops.use_backend("triton"), LaunchRecorder(execute=False) as served:
        engine.llm.generate(prompts, params, use_tqdm=False)
    # Ours only: on Model Runner V2 vLLM's own input preparation and sampling are Triton kernels too.
    ours = lambda launch: kernel_name(launch.kernel).startswith("vllm_evict.")  # noqa: E731
    warm_keys = {key for key in warm.variants() if key[0].startswith("vllm_evict.")}
    served_keys = {key for key in served.variants() if key[0].startswith("vllm_evict.")}
    assert sum(map(ours, served.launches)) > 100, "serving launched (almost) no eviction kernel"
    missing = sorted(served_keys - warm_keys, key=str)
    assert not missing, "variants serving needed that the warm-up did not compile:\n" + "\n".join(map(str, missing))
    # No per-step number is specialised: launches of one kernel on one cache tensor (one layer's K, V,
    # positions or state) with the same constexprs pass every specialised integer with one value.
    values: dict[tuple, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for launch in filter(ours, warm.launches + served.launches):
        bound = launch.bound()
        ints, _ = unspecialised(launch.kernel)
        first = next(v for v in bound.values() if isinstance(v, torch.Tensor))
        group = (kernel_name(launch.kernel), launch.key[1], first.data_ptr())
        for name, value in bound.items():
            if isinstance(value, int) and not isinstance(value, bool) and name not in ints:
                values[group][name].add(value)
    varying = {(g[0].rsplit(".", 1)[-1], name): sorted(v)[:6] for g, by_name in values.items()
               for name, v in by_name.items() if len(v) > 1}
    assert not varying, f"specialised integers that change from launch to launch: {varying}"
    launched = {key[0].rsplit(".", 1)[-1] for key in served_keys}
    assert {"_window_lse_kernel", "_window_colsum_kernel", "_keydiff_sum_kernel", "_center_sum_kernel",
            "_value_norms_kernel", "_compact_kernel"} <= launched, launched


def test_the_warm_up_runs_inside_vllms_kernel_warm_up():
    """On a GPU the eviction warm-up is one kernel of the model runner's JIT warm-up registry, which vLLM
    compiles in its kernel warm-up, before its JIT monitor starts watching (no "JIT compilation during
    inference" for ours); without a registry, or with vLLM's JIT warm-up off, the caller warms up at once."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    from vllm_evict.engine.warmup import warm_up_in_vllm

    runs: list[str] = []
    registry = JitWarmupRegistry(None)
    assert not warm_up_in_vllm(None, True, lambda: runs.append("now"))
    assert not warm_up_in_vllm(registry, False, lambda: runs.append("now")) and len(registry) == 0
    assert warm_up_in_vllm(registry, True, lambda: runs.append("vllm")) and runs == []
    registry.warmup()  # what vLLM's kernel_warmup does
    assert runs == ["vllm"]
