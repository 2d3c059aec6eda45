"""Runner-side guards for vLLM's GPU runner, driven through the real CPU runner (which is a subclass of
vLLM's GPUModelRunner and shares these code paths): hooks installed exactly once even when vLLM builds
a throw-away KV cache to profile CUDA-graph memory, no eviction in forwards outside a scheduled step,
the kernel-block-size check, the CUDA extension loaded at start-up, and eviction's buffers counted in
the KV-cache memory before vLLM sizes the pool."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import PAGE_BYTES_TINY, greedy, runner_kind, token_prompt
from vllm_evict.engine.runner import HOOK_ATTR

pytestmark = pytest.mark.engine

SNAPKV = {"policy": "snapkv", "budget": 64}


def hooked_forwards(engine):
    layers = [m for m in engine.runner.compilation_config.static_forward_context.values() if hasattr(m, "impl")]
    return [m.impl.forward for m in layers]


def count_layer_steps(engine, prompt, params):
    """(eviction-hook calls, steps with per-layer work) while ``engine`` runs one request (a decode step
    far from any eviction has no work per layer: the hook does not call the layer's step)."""
    runner = engine.runner
    calls, steps = [0], [0]
    original_layer, original_build = runner._evict_layer, runner.evict_builder.build

    def layer(*args):
        calls[0] += 1
        return original_layer(*args)

    def build(*args):
        built = original_build(*args)
        steps[0] += built is not None and built.layer_work
        return built

    runner._evict_layer, runner.evict_builder.build = layer, build
    try:
        engine.llm.generate([prompt], params)
    finally:
        runner._evict_layer, runner.evict_builder.build = original_layer, original_build
    return calls[0], steps[0]


def test_profiling_kv_cache_does_not_install_hooks_twice(tiny_llama, engine_factory):
    """vLLM 0.33 calls initialize_kv_cache(is_profiling=True) for a throw-away cache when it profiles
    CUDA-graph memory, then again for the real one: every layer must still evict once per step."""
    engine = engine_factory(tiny_llama, SNAPKV)
    runner = engine.runner
    config = runner.kv_cache_config
    # vLLM's own sequence when it profiles CUDA-graph memory (gpu_worker -> profile_cudagraph_memory):
    # a minimal cache with is_profiling=True, cleaned up, then the real one.
    compilation = runner.compilation_config
    saved = compilation.max_cudagraph_capture_size, runner.cache_config.num_gpu_blocks
    compilation.max_cudagraph_capture_size = 8  # set on a GPU with CUDA graphs; None in eager mode
    if runner_kind(runner) == "v1":
        cleanup, init_minimal = runner._cleanup_profiling_kv_cache, runner._init_minimal_kv_cache_for_profiling
    else:  # Model Runner V2: the same sequence, in vllm/v1/worker/gpu/cudagraph_utils.py
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.gpu import cudagraph_utils

        def cleanup() -> None:
            cudagraph_utils._teardown_profiling_state(runner)

        def init_minimal() -> None:
            with set_current_vllm_config(runner.vllm_config):
                cudagraph_utils._init_minimal_kv_cache_for_profiling(runner)
    try:
        cleanup()
        init_minimal()
        assert runner.evict_buffers.geometry.num_pages == config.num_blocks, "hooked the profiling cache"
        cleanup()
        runner.initialize_kv_cache(config)
    finally:
        compilation.max_cudagraph_capture_size, runner.cache_config.num_gpu_blocks = saved
    for forward in hooked_forwards(engine):
        original = getattr(forward, HOOK_ATTR)
        assert not hasattr(original, HOOK_ATTR), "a hook wraps another hook"
    calls, steps = count_layer_steps(engine, token_prompt(200), greedy(40))
    assert calls == steps * len(runner.evict_layers)
    out = engine.llm.generate([token_prompt(200)], greedy(40))[0]
    assert len(out.outputs[0].token_ids) == 40 and engine.free_pages() == engine.total_pages()


def test_forward_outside_a_scheduled_step_never_evicts(tiny_llama, engine_factory):
    """Data-parallel idle ranks and profiling run forwards of their own (``_dummy_run``): the step's plan
    is cleared after every scheduled forward, so those never reach the eviction step."""
    engine = engine_factory(tiny_llama, SNAPKV)
    runner = engine.runner
    engine.llm.generate([token_prompt(200)], greedy(4))
    assert runner.evict_step is None
    calls = [0]
    original = runner._evict_layer
    runner._evict_layer = lambda *args: calls.__setitem__(0, calls[0] + 1)
    try:
        runner._dummy_run(16)
    finally:
        runner._evict_layer = original
    assert calls[0] == 0


def test_kernel_block_size_must_equal_the_page_size(tiny_llama, engine_factory):
    """The scheduler frees manager blocks; a backend that splits them into smaller kernel blocks is
    refused with the block size to use."""
    engine = engine_factory(tiny_llama, SNAPKV)
    runner = engine.runner
    block_size = runner.cache_config.block_size
    runner.cache_config.block_size = 2 * block_size
    try:
        with pytest.raises(ValueError, match=f"kernel block size \\({block_size} tokens\\) to equal the KV cache "
                                             f"block size \\({2 * block_size}\\); start the server with "
                                             f"--block-size {block_size}"):
            runner._install_eviction()
    finally:
        runner.cache_config.block_size = block_size


def test_cuda_extension_is_loaded_at_start_up(tiny_llama, engine_factory):
    """The extension is built (or found missing) when the hooks are installed, before any forward."""
    from vllm_evict import csrc

    csrc._tried, csrc._module = False, None
    engine_factory(tiny_llama, SNAPKV)
    assert csrc._tried
    if not torch.cuda.is_available():
        assert csrc.load_error()


def test_eviction_buffers_are_counted_in_the_kv_memory(tiny_llama, engine_factory):
    """Same kv_cache_memory_bytes: the eviction engine's pool is smaller than vanilla's by exactly its
    buffers (a fixed-mode server keeps no queries: positions and the reserved states per token and KV
    head), and what the worker allocated fits in what was taken from the pool."""
    pages = 256
    plain = engine_factory(tiny_llama, pages=pages)
    evicting = engine_factory(tiny_llama, SNAPKV, pages=pages)
    runner = evicting.runner
    buffers = runner.evict_buffers
    assert buffers.ring is None and buffers.ring_positions is None
    assert set(buffers.states) == {"wmass"}  # the reservation of a snapkv server
    layers, kv_heads, head_size = 2, 2, 32  # the tiny Llama
    block = runner.cache_config.block_size
    kv_per_token = layers * kv_heads * head_size * 2 * 4
    ours_per_token = layers * kv_heads * (4 + 4 * len(buffers.states))
    expected_bytes = int(pages * PAGE_BYTES_TINY * kv_per_token / (kv_per_token + ours_per_token))
    assert plain.total_pages() + 1 == pages
    assert evicting.total_pages() + 1 == expected_bytes // (kv_per_token * block)
    assert buffers.nbytes <= pages * PAGE_BYTES_TINY - (evicting.total_pages() + 1) * kv_per_token * block
