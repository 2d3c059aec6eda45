"""CriticalKV is refused on quantized checkpoints, at start-up and per request, and the worker never
reads a quantized output projection as if it were the matrix (an fp8 ``weight`` is stored transposed
and scaled: read raw, it selects the wrong tokens silently)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_evict.config import EvictionConfig
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


def test_a_server_reserving_criticalkv_for_requests_on_a_quantized_model_is_refused():
    """Requests may only choose methods the server reserved (``request_policies``), so the start-up check
    of the server's own method and of its reserved ones covers every request."""
    from vllm_evict.config import ServerConfig

    quantized = vllm_config("compressed-tensors")
    reserving = ServerConfig.from_mapping({"policy": "snapkv", "budget": 128,
                                           "request_policies": ["h2o", "criticalkv+snapkv"]})
    with pytest.raises(ValueError, match=r"quantized \(compressed-tensors\); choose a method without criticalkv"):
        check_policy_supported(quantized, reserving)
    check_policy_supported(vllm_config(None), reserving)
    check_policy_supported(quantized, ServerConfig.from_mapping({"policy": "snapkv", "budget": 128,
                                                                 "request_policies": ["h2o"]}))


def test_a_request_for_criticalkv_the_server_did_not_reserve_is_refused():
    from vllm_evict.request_settings import RequestRefused, resolve, server_settings

    server = server_settings({"policy": "snapkv", "budget": 128})
    with pytest.raises(RequestRefused, match=r"needs each attention layer's output projection \(o_proj\)"):
        resolve(server, {"kv_eviction": "criticalkv+snapkv"})
    assert resolve(server, {"kv_eviction": "keydiff"}).config.policy == "keydiff"


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
