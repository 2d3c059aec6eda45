"""Eviction over an fp8 KV cache (#29), on CPU: the dtype guard, the layout probe of a quantising backend,
the warm-up over float8 views, and the HF reference with vLLM's fp8 cache (stored = fp8(k / scale)) against
the same request on a full-precision cache. The kernels' fp8 paths are in tests/kernels/test_fp8.py; the
engine over FA3's fp8 cache runs in the GPU script (``benchmarks/gpu.py`` phase ``engine-fp8``)."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import guards, ops, reference
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.layout import probe_kv_layout
from vllm_evict.engine.warmup import WarmupGeometry, warm_up
from vllm_evict.kernels.variants import LaunchRecorder, kernel_name

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def test_fp8_names_are_accepted_and_map_to_their_element_type():
    for name, dtype in FP8.items():
        guards.check_kv_cache_dtype(name)
        assert guards.fp8_storage_dtype(name) is dtype
    for name in ("auto", "bfloat16", "float16", "float32"):
        guards.check_kv_cache_dtype(name)
        assert guards.fp8_storage_dtype(name) is None
    with pytest.raises(ValueError, match=r"^KV eviction does not support the KV cache dtype fp8_inc \(its scales are "
                                         r"not per layer\); use --kv-cache-dtype auto or fp8 \(supported: auto, "
                                         r"float16, bfloat16, float32, fp8, fp8_e4m3, fp8_e5m2\)$"):
        guards.check_kv_cache_dtype("fp8_inc")


class QuantisingBackend:
    """A backend that stores K and V as vLLM's GPU backends do for fp8: bytes of fp8(x / scale) in a
    [2, num_blocks, bs, H, d] uint8 cache (``stacked_nhd``). ``scaled=False``: forgets the scale (a layout
    that reads back wrong values must not be taken)."""

    def __init__(self, fp8: torch.dtype, scaled: bool = True) -> None:
        self.fp8, self.scaled = fp8, scaled

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
        bs = kv_cache.shape[2]
        for i, (x, scale) in enumerate(((key, layer._k_scale), (value, layer._v_scale))):
            stored = (x.float() / scale if self.scaled else x.float()).to(self.fp8).view(torch.uint8)
            kv_cache[i][slots // bs, slots % bs] = stored


def layer_with_scales(k_scale: float, v_scale: float) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor([k_scale]), torch.tensor([v_scale])
    return layer


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_probe_finds_an_fp8_layout_and_gives_float8_views(name):
    fp8, heads, bs, d = FP8[name], 2, 16, 32
    layer = layer_with_scales(0.5, 0.25)
    kv_cache = torch.zeros(2, 4, bs, heads, d, dtype=torch.uint8)
    found, views = probe_kv_layout(QuantisingBackend(fp8), layer, kv_cache, heads, d, fp8=fp8,
                                   input_dtype=torch.bfloat16)
    assert found == "stacked_nhd"
    k, v = views(kv_cache)
    assert k.dtype == v.dtype == fp8 and tuple(k.shape) == (4, heads, bs, d)
    assert not kv_cache[:, 0].any(), "the probe leaves the null page zeroed"
    # What a backend writes afterwards reads back through the views, dequantised with the layer's scales.
    keys, values = torch.randn(3, heads, d).bfloat16(), torch.randn(3, heads, d).bfloat16()
    slots = torch.tensor([17, 18, 40])
    QuantisingBackend(fp8).do_kv_cache_update(layer, keys, values, kv_cache, slots)
    got_k = k[slots // bs, :, slots % bs].float() * 0.5
    got_v = v[slots // bs, :, slots % bs].float() * 0.25
    rel = torch.finfo(fp8).eps / 2
    assert torch.all((got_k - keys.float()).abs() <= rel * keys.float().abs() + 2e-3)
    assert torch.all((got_v - values.float()).abs() <= rel * values.float().abs() + 2e-3)


def test_probe_refuses_an_fp8_cache_that_does_not_read_back_with_the_scales():
    layer = layer_with_scales(0.5, 0.25)
    kv_cache = torch.zeros(2, 4, 16, 2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="could not find how QuantisingBackend"):
        probe_kv_layout(QuantisingBackend(torch.float8_e4m3fn, scaled=False), layer, kv_cache, 2, 32,
                        fp8=torch.float8_e4m3fn, input_dtype=torch.bfloat16)


def test_warm_up_launches_float8_variants_over_an_fp8_cache():
    """The start-up warm-up runs every method over float8 views with the scales (the GPU's compile list):
    its window kernels read fp8 keys with bf16 queries, and no lent window page is written (none is lent
    over an fp8 cache)."""
    pages, heads, bs, d = 2, 2, 16, 32
    storage = torch.zeros(2, pages, bs, heads, d, dtype=torch.uint8)
    k, v = (storage[i].view(torch.float8_e4m3fn).transpose(1, 2) for i in range(2))
    scale = torch.tensor([0.5])
    geometry = WarmupGeometry(k=k, v=v, query_heads=6, scale=d ** -0.5, k_scale=scale, v_scale=scale,
                              dtype=torch.bfloat16)
    with ops.use_backend("triton"), LaunchRecorder(execute=False) as launches:
        skipped = warm_up(geometry, o_proj=lambda: torch.zeros(6 * d, 6 * d, dtype=torch.bfloat16))
    assert skipped == []
    cache_reads: dict[str, set] = {}
    for launch in launches.launches:
        bound = launch.bound()
        for name in ("k_ptr", "v_ptr"):
            if isinstance(bound.get(name), torch.Tensor):
                query = bound.get("q_ptr")
                cache_reads.setdefault(kernel_name(launch.kernel).rsplit(".", 1)[-1], set()).add(
                    (bound[name].dtype, query.dtype if isinstance(query, torch.Tensor) else None))
                if bound[name].dtype == torch.float8_e4m3fn:  # read from the cache: with the layer's own scale
                    assert bound.get("SCALED") is True, (kernel_name(launch.kernel), bound.get("SCALED"))
                    assert any(value is scale for value in bound.values()), kernel_name(launch.kernel)
    assert cache_reads["_window_lse_kernel"] == cache_reads["_window_colsum_kernel"] == {
        (torch.float8_e4m3fn, torch.bfloat16)}, cache_reads
    for kernel in ("_keydiff_sum_kernel", "_keydiff_score_kernel", "_center_sum_kernel", "_output_error_kernel"):
        assert cache_reads[kernel] == {(torch.float8_e4m3fn, None)}, (kernel, cache_reads.get(kernel))
    # CriticalKV's value norms are computed from the step's values (rounded through fp8), not read back
    assert cache_reads["_value_norms_kernel"] == {(torch.bfloat16, None)}, cache_reads.get("_value_norms_kernel")


SPECS = ["snapkv", "keydiff", "h2o", "tova", "knorm", "ahakv", "nacl", "random", "streamingllm", "caote+snapkv",
         "criticalkv+snapkv"]
TEXT = ("The Roman Empire was the post-Republican state of ancient Rome. It included large territorial holdings "
        "around the Mediterranean Sea in Europe, North Africa, and Western Asia, and was ruled by emperors. The pass "
        "key is 71432. Remember it. From the accession of Caesar Augustus as the first Roman emperor to the military "
        "anarchy of the 3rd century, it was a Principate with Italia as the metropole of its provinces and the city "
        "of Rome as its sole capital. What is the pass key?")


@pytest.fixture(scope="module")
def smollm2(smollm2_path, one_intra_op_thread):
    return reference.load_model(smollm2_path, dtype=torch.float32)


def overlap(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Per (layer, KV head): the share of ``a``'s kept positions that ``b`` kept too."""
    return [len(set(x.tolist()) & set(y.tolist())) / max(len(x), 1)
            for pa, pb in zip(a, b) for x, y in zip(pa, pb)]


@pytest.mark.parametrize("spec", SPECS)
def test_reference_over_fp8_keeps_what_full_precision_keeps(smollm2, spec):
    """The reference with vLLM's fp8 cache (the attention and every score read K and V dequantised) keeps
    the same number of tokens as on the model's own dtype, and mostly the same tokens: position-only methods
    (StreamingLLM, the seeded random eviction) exactly the same; the scoring ones above 85% per head on
    average (measured 0.94 to 0.99 on this prompt, docs/benchmarks/fp8.md)."""
    model, tokenizer = smollm2
    ids = reference.prompt_token_ids(tokenizer, TEXT)
    config = EvictionConfig.from_spec(spec, 48)
    full = reference.run_reference(model, ids, config, 3, chunk_size=32, page_size=16)
    fp8 = reference.run_reference(model, ids, config, 3, chunk_size=32, page_size=16, kv_cache_dtype="fp8",
                                  kv_scale=0.5)
    assert fp8.kept_counts == full.kept_counts
    shares = overlap(full.kept_positions, fp8.kept_positions)
    if spec in ("random", "streamingllm"):
        assert min(shares) == 1.0
    else:
        assert sum(shares) / len(shares) >= 0.85, (spec, sum(shares) / len(shares))
        assert min(shares) < 1.0 or spec == "nacl", "fp8 rounding should move some scores"


def test_reference_fp8_scores_through_the_triton_kernels_keep_what_the_torch_reference_keeps(smollm2):
    """The same fp8 request with the eviction operations on the Triton kernels (interpreter) and on the
    PyTorch reference: the kernels get the scales through the engine's own path (``PagedScoreOps``) and
    dequantise as the reference does: H2O's attention mass (the window kernels over the fp8 keys) and CAOTE's
    output error over the fp8 values (KeyDiff's kernel gets its scale the same way: its fp8 launches are in
    ``test_warm_up_launches_float8_variants_over_an_fp8_cache``, its results in tests/kernels/test_fp8.py)."""
    model, tokenizer = smollm2
    ids = reference.prompt_token_ids(tokenizer, TEXT)[:64]
    for spec in ("caote+h2o",):
        config = EvictionConfig.from_spec(spec, 40)
        run = lambda: reference.run_reference(model, ids, config, 1, chunk_size=32, page_size=16,  # noqa: E731
                                              kv_cache_dtype="fp8_e5m2", kv_scale=0.75)
        want = run()
        with ops.use_backend("triton"):
            got = run()
        assert want.trace and got.trace, "nothing was evicted"
        shares = overlap(want.kept_positions, got.kept_positions)
        assert sum(shares) / len(shares) >= 0.99, (spec, sum(shares) / len(shares))
