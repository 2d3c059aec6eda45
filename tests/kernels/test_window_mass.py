"""Observation-window attention mass (and AhaKV's gain) against attention_column_sums over gathered keys."""

from __future__ import annotations

import pytest
import torch

from vllm_evict import ops, paged
from vllm_evict.policies.attention import pool_in_position_order
from vllm_evict.policies.base import EvictionInputs
from vllm_evict.policies.snapkv import SnapKV

from kernel_cases import TOL, assert_same_keep, block_table, make_kv, positions_buffer

BS = 16


def _case(device, dtype, group, d, heads=2, lengths=(75, 40, 17), windows=(8, 20, 1), layout="nhd", seed=0,
          with_positions=False, with_gain=False):
    nb = sum(-(-n // BS) for n in lengths) + 3
    k, _ = make_kv(nb, heads, BS, d, dtype, layout, device, seed=seed)
    table = block_table(list(lengths), BS, nb, device, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    qsl = torch.tensor([0, *torch.tensor(windows).cumsum(0).tolist()], device=device)
    t = int(qsl[-1])
    queries = (torch.randn(t, heads * group, d, generator=g) * 1.5).to(dtype).to(device)
    pos = positions_buffer(nb, heads, BS, table, list(lengths), device, seed) if with_positions else None
    qpos = []
    for n, w in zip(lengths, windows):
        top = 2 * n if with_positions else n
        qpos.append(torch.arange(top - w, top))  # the newest queries of the request
    qpos = torch.cat(qpos).to(device)
    gain = (torch.rand(t, generator=g) * 2 + 0.3).to(device) if with_gain else None
    lens = torch.tensor(lengths, device=device)
    return dict(k_cache=k, block_table=table, lengths=lens, queries=queries, query_start_loc=qsl,
                query_positions=qpos, scale=d ** -0.5, positions=pos, gain=gain)


def _check(out, ref, lengths, dtype):
    tol = TOL[dtype]
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * 1e-2)
    flat_out = out.flatten(1, -2) if out.dim() == 4 else out
    flat_ref = ref.flatten(1, -2) if ref.dim() == 4 else ref
    assert_same_keep(flat_out, flat_ref, list(lengths), budget=12, rtol=tol)


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_window_mass(device, kernel_backend, group, dtype):
    case = _case(device, dtype, group, 64, layout="nhd" if group != 3 else "cpu", seed=group)
    out = ops.window_attention_mass(**case, backend=kernel_backend)
    ref = paged.paged_window_attention_mass(**case)
    assert ref.abs().sum() > 0
    _check(out, ref, case["lengths"].tolist(), dtype)


@pytest.mark.parametrize("with_gain", [False, True])
def test_window_mass_positions_and_gain(device, kernel_backend, with_gain):
    """Compacted slots (per-head, out-of-order positions) and AhaKV's per-row gain."""
    case = _case(device, torch.bfloat16, 3, 64, layout="hnd", seed=11, with_positions=True, with_gain=with_gain)
    out = ops.window_attention_mass(**case, backend=kernel_backend)
    ref = paged.paged_window_attention_mass(**case)
    _check(out, ref, case["lengths"].tolist(), torch.bfloat16)


def test_window_mass_head_dim_128_per_head(device):
    case = _case(device, torch.bfloat16, 3, 128, lengths=(50, 33), windows=(6, 9), layout="cpu", seed=5)
    out = ops.window_attention_mass(**case, reduce_group=False, backend="triton")
    ref = paged.paged_window_attention_mass(**case, reduce_group=False)
    assert out.shape == (2, 2, 3, 50)
    _check(out, ref, [50, 33], torch.bfloat16)


def test_window_mass_feeds_snapkv(device):
    """Group mean + pooling of the kernel's mass reproduces SnapKV.window_mass/attention_mass."""
    case = _case(device, torch.float32, 3, 64, lengths=(45,), windows=(8,), seed=3)
    out = ops.window_attention_mass(**case, backend="triton")[0] / 3
    ids = case["block_table"][0].long()
    keys = paged.gather_tokens(case["k_cache"], ids, 45)
    inp = EvictionInputs(keys=keys, values=keys, positions=torch.arange(45, device=device).expand(2, 45),
                         queries=case["queries"].transpose(0, 1), query_positions=case["query_positions"],
                         scale=case["scale"], seq_len=45, num_new=8)
    policy = SnapKV(window=8)
    torch.testing.assert_close(out, policy.window_mass(inp), rtol=1e-4, atol=1e-6)
    pooled = pool_in_position_order(out, inp.positions, policy.kernel, policy.pooling)
    torch.testing.assert_close(pooled, policy.attention_mass(inp), rtol=1e-4, atol=1e-6)


def test_cpu_tensors_use_the_reference_by_default():
    case = _case(torch.device("cpu"), torch.float32, 1, 64, lengths=(20,), windows=(4,))
    assert ops.select_backend("window_attention_mass", torch.device("cpu")) == "torch"
    torch.testing.assert_close(ops.window_attention_mass(**case), paged.paged_window_attention_mass(**case))
