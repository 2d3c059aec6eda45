"""CriticalKV is refused on quantized checkpoints, at start-up and per request, and the worker never
reads a quantized output projection as if it were the matrix (an fp8 ``weight`` is stored transposed
and scaled: read raw, it selects the wrong tokens silently)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_evict.config import EvictionConfig, resolve_request_config
from vllm_evict.guards import check_policy_supported, o_proj_unavailable


def vllm_config(quantization):
    return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization))


@pytest.mark.parametrize("spec", ["criticalkv+snapkv", "criticalkv+ahakv"])
def test_criticalkv_is_refused_on_a_quantized_model(spec):
    config = EvictionConfig.from_spec(spec, 256)
    with pytest.raises(ValueError, match=r"quantized \(fp8\); choose a method without criticalkv"):
        check_policy_supported(vllm_config("fp8"), config)
    check_policy_supported(vllm_config(None), config)  # full-precision weights: fine


def test_other_methods_run_on_a_quantized_model():
    for spec in ("snapkv", "caote+snapkv", "h2o"):
        check_policy_supported(vllm_config("fp8"), EvictionConfig.from_spec(spec, 256))
    check_policy_supported(vllm_config("fp8"), None)  # eviction off for the request
    assert o_proj_unavailable(vllm_config(None)) is None


def test_a_request_asking_for_criticalkv_on_a_quantized_model_gets_the_reason():
    from vllm_evict.openai_server import settings_error

    config = SimpleNamespace(model_config=SimpleNamespace(quantization="compressed-tensors"),
                             additional_config={"kv_eviction": {"policy": "snapkv", "budget": 128}})
    message = settings_error(config, {"kv_eviction": "criticalkv+snapkv"})
    assert message and "quantized (compressed-tensors)" in message
    assert settings_error(config, {"kv_eviction": "keydiff"}) is None
    assert resolve_request_config(config.additional_config["kv_eviction"], {"kv_eviction": "criticalkv+snapkv"})


class Linear(torch.nn.Module):
    def __init__(self, weight, method):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = method


def test_the_worker_reads_only_unquantized_output_projections():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from vllm_evict.engine.runner import o_proj_matrix

    w = torch.randn(8, 12, dtype=torch.bfloat16)
    assert o_proj_matrix(Linear(w, UnquantizedLinearMethod()), "l.o_proj", torch.bfloat16) is not None
    fp8 = w.t().contiguous().to(torch.float8_e4m3fn)  # stored as a kernel wants it: [in, out]
    with pytest.raises(ValueError, match="l.o_proj is quantized"):
        o_proj_matrix(Linear(fp8, object()), "l.o_proj", torch.bfloat16)
    with pytest.raises(ValueError, match="holds torch.float8_e4m3fn weights"):
        o_proj_matrix(Linear(fp8, UnquantizedLinearMethod()), "l.o_proj", torch.bfloat16)
