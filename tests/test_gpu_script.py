"""benchmarks/gpu.py, the one-command GPU run, tested where no GPU is: its dummy-model folders, its plan
(``--dry-run``), its report, and its device-only parts failing loudly without CUDA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu  # noqa: E402


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=NO_GPU, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from vllm_evict.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tok"))


def test_prepare_writes_dummy_model_folders_with_the_target_geometry(tokenizer_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    done = run("prepare", "--out", str(tmp_path / "models"), "--tokenizer", str(tokenizer_dir))
    assert done.returncode == 0, done.stderr
    big = AutoConfig.from_pretrained(tmp_path / "models" / "llama8b")
    assert (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads,
            big.intermediate_size, big.head_dim) == (4096, 32, 32, 8, 14336, 128)
    assert big.rope_scaling["rope_type"] == "llama3" and big.vocab_size == 512  # the tokenizer's vocabulary
    small = AutoConfig.from_pretrained(tmp_path / "models" / "small")
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (9, 3, 64)
    tok = AutoTokenizer.from_pretrained(tmp_path / "models" / "small")
    assert tok("t1 t2 t3")["input_ids"] == AutoTokenizer.from_pretrained(tokenizer_dir)("t1 t2 t3")["input_ids"]
    assert not list((tmp_path / "models").rglob("*.safetensors")), "no weights travel"


def test_prepare_refuses_a_folder_without_a_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        gpu.build_model_dirs(tmp_path / "out", tmp_path)


def test_dry_run_walks_every_phase_without_a_gpu():
    done = run("run", "--dry-run", "--out", "/tmp/gpu-out")
    assert done.returncode == 0, done.stderr
    for phase in ("env", "kernels", "contract", "engine", "bench"):
        assert f"  {phase} " in done.stdout
    assert "tests/kernels -m gpu" in done.stdout and "gpu.py engine --model .gpu/models/small" in done.stdout
    assert "gpu.py bench --model .gpu/models/llama8b" in done.stdout
    assert run("run", "--dry-run", "--phases", "engine,nope").returncode != 0


@pytest.mark.parametrize("command", [["run"], ["bench", "--model", "m", "--json", "j"]])
def test_device_parts_fail_loudly_without_cuda(command):
    done = run(*command)
    assert done.returncode == 2 and "no CUDA device is visible" in done.stderr, (done.returncode, done.stderr[-500:])


def test_report_tables_from_results():
    results = {"started": "2026-11-26 10:00:00", "seconds": 512.0, "phases": {
        "env": {"status": "ok", "seconds": 40, "data": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11",
                                                         "triton": "3.6",
                                                         "vllm": "0.33.0", "cuda_extension": "built",
                                                         "kernels": {"compact_tokens": "cuda"}}},
        "kernels": {"status": "failed", "seconds": 80},
        "contract": {"status": "skipped", "reason": "10 s left, needs ~30"},
        "engine": {"status": "ok", "seconds": 150, "data": {"checks": [
            {"name": "budget above every length gives vanilla's tokens", "ok": True, "detail": "24/24"},
            {"name": "no host-device sync", "ok": False, "detail": "2 syncs"}]}},
        "bench": {"status": "ok", "seconds": 200, "data": {"notes": ["KV memory 20 GiB"], "scenarios": [
            {"name": "equal KV memory", "variants": [
                {"name": "vanilla", "tokens_per_s": 1000.0, "generated_per_s": 10.0, "max_running": 8,
                 "step_ms_mean": 50.0, "eviction_share": 0.0, "preemptions": 0},
                {"name": "keydiff 1024", "tokens_per_s": 3500.0, "generated_per_s": 35.0, "max_running": 52,
                 "step_ms_mean": 40.0, "eviction_share": 0.031, "preemptions": 0}]}]}}}}
    md = gpu.markdown(results)
    assert "| kernels | failed | 80 |" in md and "| contract | skipped: 10 s left, needs ~30 | - |" in md
    assert "NVIDIA H100 80GB HBM3" in md and "compact_tokens=cuda" in md
    assert "| budget above every length gives vanilla's tokens | pass: 24/24 |" in md
    assert "| no host-device sync | FAIL: 2 syncs |" in md
    assert "| equal KV memory | keydiff 1024 | 3500 | 35 | 3.50x | 52 | 40.0 | 3.1% | 0 |" in md
    assert "KV memory 20 GiB" in md


def test_the_device_script_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_run.sh")]).returncode == 0
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck:
        done = subprocess.run([shellcheck, str(REPO / "benchmarks" / "gpu_run.sh")], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
