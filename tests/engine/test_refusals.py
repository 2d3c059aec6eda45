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


def test_eviction_sets_scheduler_worker_and_turns_prefix_caching_off(tiny_llama):
    config = engine_config(tiny_llama)
    assert str(config.scheduler_config.scheduler_cls) == "vllm_evict.engine.scheduler.EvictScheduler"
    assert config.parallel_config.worker_cls == "vllm_evict.engine.worker.EvictCPUWorker"
    assert config.cache_config.enable_prefix_caching is False
    assert config.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("kwargs,message", [
    ({"enable_prefix_caching": True}, "drop --enable-prefix-caching"),
    ({"async_scheduling": True}, "drop --async-scheduling"),
    ({"kv_cache_dtype": "fp8"}, "does not support a quantized KV cache"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "does not support speculative decoding"),
])
def test_unsupported_engine_options_are_refused(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_llama, **kwargs)


def test_v2_model_runner_is_refused(tiny_llama, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="runs on vLLM's V1 model runner"):
        engine_config(tiny_llama)


@pytest.mark.parametrize("mapping,message", [
    ({"policy": "nope", "budget": 10}, "unknown eviction policy 'nope'"),
    ({"policy": "snapkv", "budget": 16}, "budget 16 must be larger than the 32 tokens snapkv always keeps"),
    ({"policy": "snapkv"}, "a KV budget is required"),
])
def test_bad_server_eviction_settings_are_refused(tiny_llama, mapping, message):
    with pytest.raises(ValueError, match=message):
        engine_config(tiny_llama, extra={"kv_eviction": mapping})


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
