"""Eviction's memory is a small, fixed share of the KV cache (issue #19 item 3): at most 3% at
``make run``'s settings (measured on the real engine) and, by the worker's own formula, for a
Llama-3.1-8B-shaped model in bf16 with a 60 GiB pool and 1,024 sequences. A fixed-mode server reserves
no queries (a decode window's queries wait only in free pages of the pool the scheduler lends, and are
otherwise accumulated per token), so the share does not depend on the batch size or on the pool: per (token, layer, KV head), 4 bytes of position and 4 per reserved state against
2 x head_size x dtype bytes of K and V."""

from __future__ import annotations

import pytest

from vllm_evict.engine.buffers import bytes_per_token, eviction_bytes, kv_share, layout_for

MAKE_RUN = {"policy": "caote+snapkv", "budget": 256}  # the Makefile's RUN_EVICTION
GIB = 1 << 30


def share_of(server: dict, *, layers: int, kv_heads: int, query_heads: int, head_size: int, element: int,
             available: int, rows: int) -> float:
    """The share of ``available`` KV-cache bytes eviction's buffers take, by the worker's rule
    (``EvictRunnerMixin.evict_kv_share``)."""
    layout = layout_for(server)
    ring = eviction_bytes(layers=layers, kv_heads=kv_heads, query_heads=query_heads, head_size=head_size,
                          element=element, layout=layout, pool_tokens=0, rows=rows)
    ours = bytes_per_token(layers, kv_heads, query_heads // kv_heads, layout)
    kv = layers * kv_heads * head_size * 2 * element
    return (available - kv_share(available, kv_per_token=kv, ours_per_token=ours, fixed=ring)) / available


LLAMA_8B = dict(layers=32, kv_heads=8, query_heads=32, head_size=128, element=2)  # bf16


@pytest.mark.parametrize("budget", [256, 1024, 2048])
def test_llama_8b_bf16_60_gib_1024_sequences(budget):
    share = share_of({**MAKE_RUN, "budget": budget}, **LLAMA_8B, available=60 * GIB, rows=1024)
    assert share <= 0.03, share
    # 8 of every 520 bytes per (token, layer, KV head): position and window mass next to 512 of K and V.
    assert share == pytest.approx(8 / (512 + 8), rel=1e-6)


def test_the_share_follows_the_reserved_states_not_the_batch():
    one = share_of(MAKE_RUN, **LLAMA_8B, available=60 * GIB, rows=1)
    assert share_of(MAKE_RUN, **LLAMA_8B, available=60 * GIB, rows=1024) == one
    assert share_of(MAKE_RUN, **LLAMA_8B, available=8 * GIB, rows=1024) == pytest.approx(one, rel=1e-6)
    # Every state a server reserves for its request_policies costs 4 bytes more per (token, layer, head):
    # H2O's accumulated mass, and for criticalkv+snapkv the per-query-head window mass SnapKV's max pooling
    # reads (4 query heads a KV head), as a request may choose max pooling.
    wider = share_of({**MAKE_RUN, "request_policies": ["h2o", "criticalkv+snapkv"]}, **LLAMA_8B,
                     available=60 * GIB, rows=1024)
    assert wider == pytest.approx(32 / (512 + 32), rel=1e-6)


def test_a_query_ring_adds_max_window_queries_per_sequence():
    # Elastic requests can be compressed at any step, so they keep their last max_window queries. (Fixed-mode
    # requests keep a decode window's queries only in free pages the scheduler lends them: nothing reserved.)
    fixed = share_of(MAKE_RUN, **LLAMA_8B, available=60 * GIB, rows=1024)
    with_ring = share_of({**MAKE_RUN, "mode": "elastic"}, **LLAMA_8B, available=60 * GIB, rows=1024)
    ring = 1024 * 32 * (32 * 32 * 128 * 2 + 8)  # sequences x max_window x (layers x H_q x d x bf16 + position)
    assert with_ring == pytest.approx(fixed + ring / (60 * GIB) * (1 - fixed), rel=1e-6)
    assert with_ring == pytest.approx(0.1467, abs=1e-4)  # 1.54% + the ring: 8 GiB of the 60


@pytest.mark.engine
def test_make_run_settings_on_the_real_engine(smollm2_path):
    """``make run``'s server (SmolLM2-135M, float32, a 2 GiB KV cache, caote+snapkv at 256): the buffers
    the worker allocated, against the memory it was given for the KV cache."""
    from tests.engine.helpers import Engine
    from vllm import LLM

    llm = LLM(model=str(smollm2_path), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=2 * GIB,
              max_model_len=4096, additional_config={"kv_eviction": MAKE_RUN}, seed=0)
    engine = Engine(llm)
    try:
        buffers = engine.runner.evict_buffers
        assert buffers.ring is None and set(buffers.states) == {"wmass"}
        assert buffers.nbytes <= 0.03 * 2 * GIB, buffers.nbytes / (2 * GIB)
        # What vLLM's pool got plus what eviction holds stays within the 2 GiB.
        kv_per_token = 30 * 3 * 64 * 2 * 4
        pool = (engine.total_pages() + 1) * engine.runner.cache_config.block_size * kv_per_token
        assert pool + buffers.nbytes <= 2 * GIB
        assert buffers.nbytes / (2 * GIB) == pytest.approx(8 / (512 + 8), rel=0.02)
    finally:
        llm.llm_engine.engine_core.shutdown()
