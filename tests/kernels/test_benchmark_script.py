"""benchmarks/kernels.py keeps working without a GPU: the report skeleton, and the engine-step
measurement it times on a GPU (run here once on CPU, small context, for behaviour, not for time)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from vllm_evict import paged

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_dry_run_writes_every_table_unmeasured(bench, tmp_path):
    out = tmp_path / "kernels.md"
    assert bench.main(["--dry-run", "--out", str(out), "--contexts", "4096", "--budgets", "1024"]) == 0
    text = out.read_text()
    assert "| policy | context | budget | ops (us) | engine step (us) |" in text
    for policy in bench.POLICIES:
        assert f"| {policy} | 4k | 1k | {bench.UNMEASURED} |" in text
    assert "| window_attention_mass | triton | 4k | - | " + bench.UNMEASURED in text


def test_measure_refuses_without_gpu(bench, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench.main(["--out", str(tmp_path / "k.md")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["snapkv", "keydiff", "caote+snapkv", "criticalkv+snapkv"])
def test_engine_step_compacts_to_the_budget(bench, policy):
    context, budget = 256, 64
    case = bench.Case(context, torch.device("cpu"), dtype=torch.float32)
    step = case.engine_step(policy, budget)
    ids = case.table[0].long()
    k_before = paged.gather_tokens(case.k, ids, context).clone()
    step()
    k_after = paged.gather_tokens(case.k, ids, budget)
    # Every head's first ``budget`` slots now hold kept keys, in their original (ascending) order.
    for h in range(bench.H_KV):
        rows = (k_after[h].unsqueeze(1) == k_before[h].unsqueeze(0)).all(dim=-1).float().argmax(dim=1)
        assert torch.equal(k_before[h, rows], k_after[h]), f"head {h}: slot holds a key that was not cached"
        assert bool((rows[1:] > rows[:-1]).all()), f"head {h}: kept slots not in ascending order"
        if policy != "keydiff":  # window-based: the last 32 tokens are protected
            assert set(range(context - bench.WINDOW, context)) <= set(rows.tolist())
