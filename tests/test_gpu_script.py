"""benchmarks/gpu.py, the GPU run, tested where no GPU is: its dummy-model folders, its plan (``--dry-run``:
one engine per process, phases in order of value, both runners), its figures written as they are measured,
phases that passed not run again on the same machine, its report, the CUDA tests it runs (every one marked
``gpu``), and its device-only parts failing loudly without CUDA."""

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
    order = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and "~" in line]
    assert order == ["env", "engine-vanilla", "engine-v2", "engine-v1", "bench-v2-8k-vanilla", "bench-v2-8k-eviction",
                     "bench-v2-spare-vanilla", "bench-v2-spare-eviction", "kernels", "kernel-times", "bench-v1-8k-vanilla",
                     "bench-v1-8k-eviction", "bench-v1-spare-vanilla", "bench-v1-spare-eviction", "contract",
                     "engine-fp8", "capacity-eviction", "kernels-fp8", "capacity-vanilla"]
    commands = {name: line for name, line in zip(order, [l for l in done.stdout.splitlines() if "$ " in l])}
    # One engine per process, each on the runner it names (set before vLLM is imported).
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in commands["engine-v2"] and "--runner v2" in commands["engine-v2"]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in commands["engine-v1"] and "--runner v1" in commands["engine-v1"]
    # fp8 (#29): the engine checks over an fp8 cache, no vanilla bf16 reference; each capacity side its own engine
    assert "--kv-cache-dtype fp8" in commands["engine-fp8"] and "--reference" not in commands["engine-fp8"]
    assert commands["capacity-eviction"].endswith("--eviction") and not commands["capacity-vanilla"].endswith("--eviction")
    assert "--vanilla" in commands["engine-vanilla"] and "--reference /tmp/gpu-out/engine-vanilla.tokens.json" in \
        commands["engine-v1"]
    assert "--scenario 8k --side eviction" in commands["bench-v2-8k-eviction"] and \
        "gpu.py bench --model .gpu/models/llama8b" in commands["bench-v1-spare-vanilla"]
    assert f"pytest -q -p no:cacheprovider -rfE {' '.join(gpu.GPU_TEST_PATHS)} -m gpu" in commands["kernels"]
    assert "benchmarks/kernels.py --out /tmp/gpu-out/kernels.md" in commands["kernel-times"]
    assert run("run", "--dry-run", "--phases", "engine,nope").returncode != 0
    quick = run("run", "--dry-run", "--phases", "env,engine")
    assert [line.split()[0] for line in quick.stdout.splitlines() if "~" in line and line.startswith("  ")] == \
        ["env", "engine-vanilla", "engine-v2", "engine-v1"]


def test_the_first_run_fits_the_engine_checks_and_the_8k_comparison():
    """By the phases' own estimates, a run gets through the engine checks and the 8k comparison on V2 before
    its deadline (the default leaves 540 s for the phases, out of the 10 minutes a device call may take)."""
    args = gpu.main.__globals__["argparse"].Namespace(out="/tmp/o", models=".gpu/models", kv_gib=20.0,
                                                       requests_8k=48, full=False, phases="env,engine,bench-v2-8k")
    assert sum(p.estimate_s for p in gpu.plan(args)) <= 540 - 30  # some slack for the unknown


@pytest.mark.parametrize("command", [["run"], ["bench", "--model", "m", "--runner", "v2", "--scenario", "8k",
                                               "--side", "vanilla", "--out", "/tmp/o", "--name", "n"],
                                     ["engine", "--model", "m", "--out", "/tmp/o", "--name", "n", "--vanilla"]])
def test_device_parts_fail_loudly_without_cuda(command):
    done = run(*command)
    assert done.returncode == 2 and "no CUDA device is visible" in done.stderr, (done.returncode, done.stderr[-500:])


def test_every_figure_is_on_disk_as_soon_as_it_is_measured(tmp_path):
    records = gpu.Records(tmp_path, "bench-v2-8k-eviction")
    records.add("measure", variant="keydiff 1024", tokens_per_s=1000.0)
    # A phase killed now (a timeout, the machine taken back) has left this line in the file.
    assert gpu.read_records(tmp_path / "bench-v2-8k-eviction.jsonl") == [
        {"kind": "measure", "variant": "keydiff 1024", "tokens_per_s": 1000.0}]
    records.add("measure", variant="snapkv", tokens_per_s=900.0)
    records.finish(notes=["n"])
    summary = json.loads((tmp_path / "bench-v2-8k-eviction.json").read_text())
    assert summary["notes"] == ["n"] and [r.get("variant") for r in summary["records"]] == ["keydiff 1024", "snapkv"]
    with (tmp_path / "bench-v2-8k-eviction.jsonl").open("a") as sink:
        sink.write('{"kind": "measure", "vari')  # the last line of a process killed mid-write
    assert len(gpu.read_records(tmp_path / "bench-v2-8k-eviction.jsonl")) == 2


def test_a_phase_that_passed_is_not_run_again_on_the_same_machine(tmp_path):
    out, done = tmp_path / "out", tmp_path / "done"
    out.mkdir()
    (out / "engine-vanilla.tokens.json").write_text("[1]")
    (out / "engine-vanilla.jsonl").write_text("")
    gpu.keep("engine-vanilla", {"status": "ok", "seconds": 40}, out, done)
    later = tmp_path / "later"
    later.mkdir()
    assert gpu.reuse("engine-v2", done, later) is None
    entry = gpu.reuse("engine-vanilla", done, later)
    assert entry == {"status": "ok", "seconds": 40, "reused": True}
    # The next phase finds what it reads (the reference tokens) in this call's folder.
    assert (later / "engine-vanilla.tokens.json").read_text() == "[1]"
    assert gpu.reuse("engine-vanilla", None, later) is None


def test_every_cuda_test_is_marked_gpu_and_the_gpu_run_runs_it():
    """Every collected test that runs on CUDA (a CUDA ``device`` parameter, or tensors moved there in its
    source) carries the ``gpu`` mark, and lives where the kernels phase runs ``pytest -m gpu``."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.gpu_marks",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO, env=NO_GPU, capture_output=True, text=True,
                          timeout=600)
    found = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("CUDA-TEST ")]
    assert len(found) > 100, done.stdout[-2000:] + done.stderr[-2000:]
    unmarked = [node for mark, node in found if mark != "gpu"]
    assert not unmarked, f"CUDA tests without the gpu mark (no GPU run would execute them): {unmarked}"
    outside = [node for _, node in found if not node.startswith(gpu.GPU_TEST_PATHS)]
    assert not outside, f"gpu tests the GPU run does not collect ({gpu.GPU_TEST_PATHS}): {outside}"


def test_report_tables_from_results():
    check = lambda name, ok, detail: {"kind": "check", "name": name, "ok": ok, "detail": detail}  # noqa: E731
    row = {"kind": "measure", "runner": "v2", "scenario": "equal KV memory", "generated_per_s": 10.0,
           "step_ms_mean": 50.0, "preemptions": 0, "prefill_chunk_eviction_share": None, "decode_hook_share": None}
    results = {"started": "2026-11-26 10:00:00", "seconds": 512.0, "phases": {
        "env": {"status": "ok", "seconds": 40, "data": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11",
                                                         "triton": "3.6",
                                                         "vllm": "0.33.0", "cuda_extension": "built",
                                                         "kernels": {"compact_tokens": "cuda"}}},
        "kernels": {"status": "failed", "seconds": 80},
        "contract": {"status": "skipped", "reason": "10 s left, needs ~30"},
        "engine-v2": {"status": "ok", "seconds": 150, "data": {"records": [
            check("budget above every length gives vanilla vLLM's tokens", True, "24/24"),
            check("no host-device sync", False, "2 syncs")]}},
        "bench-v2-8k-vanilla": {"status": "ok", "seconds": 100, "data": {"notes": ["KV memory 20 GiB"], "records": [
            {**row, "variant": "vanilla", "tokens_per_s": 1000.0, "max_running": 8, "eviction_share": None}]}},
        "bench-v2-8k-eviction": {"status": "timeout", "seconds": 400, "data": {"records": [
            {**row, "variant": "keydiff 1024", "tokens_per_s": 3500.0, "max_running": 52, "eviction_share": 0.031,
             "prefill_chunk_eviction_share": 0.04, "step_ms_mean": 40.0}]}}}}
    md = gpu.markdown(results)
    assert "| kernels | failed | 80 |" in md and "| contract | skipped: 10 s left, needs ~30 | - |" in md
    assert "NVIDIA H100 80GB HBM3" in md and "compact_tokens=cuda" in md
    assert "| budget above every length gives vanilla vLLM's tokens | engine-v2 | pass: 24/24 |" in md
    assert "| no host-device sync | engine-v2 | FAIL: 2 syncs |" in md
    # A phase that timed out still reports what it measured before.
    assert "| v2 | equal KV memory | keydiff 1024 | 3500 | 10 | 3.50x | 52 | 40.0 | 3.1% | 4.0% | - | 0 |" in md
    assert "| v2 | equal KV memory | vanilla | 1000 | 10 | 1.00x | 8 | 50.0 | - | - | - | 0 |" in md
    assert "KV memory 20 GiB" in md


def test_the_device_script_is_valid_shell():
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_run.sh")]).returncode == 0
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck:
        done = subprocess.run([shellcheck, str(REPO / "benchmarks" / "gpu_run.sh")], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
