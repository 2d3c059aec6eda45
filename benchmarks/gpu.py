"""vllm-evict on a GPU, end to end in one command: kernels, host contract, the engine's correctness in
bf16 with FA3 and piecewise CUDA graphs, and vanilla vs eviction with Llama-3.1-8B geometry.

    python benchmarks/gpu.py prepare --out .gpu/models          # here: dummy-model folders (config + tokenizer)
    python benchmarks/gpu.py run --models .gpu/models --out DIR  # on the GPU machine (benchmarks/gpu_run.sh)
    python benchmarks/gpu.py run --dry-run                       # anywhere: the plan, phase by phase

``run`` executes its phases in order, each in a subprocess with its own time limit (so an engine's GPU
memory is gone when the next starts, and a hung phase cannot take the others down), and writes
``results.json`` and ``results.md`` into ``--out`` after every phase (what finished survives a machine
taken back). A phase is skipped, and says so, when the time left (``--deadline-s``) is below its
estimate. Phases:

* ``env``       GPU, versions, the CUDA extension's build and the kernels each operation uses;
* ``kernels``   ``pytest tests/kernels``: every kernel on CUDA (CUDA extension, compiled Triton) against
                the PyTorch references (bf16 within the same-dtype reference's error, as the tests say);
* ``contract``  ``pytest tests/test_host_contract.py tests/test_cli_flags.py`` with the GPU present;
* ``engine``    the small dummy model in bf16, FA3, piecewise CUDA graphs (``engine`` subcommand):
                exactness (a budget above every length gives vanilla's greedy tokens), page bounds of an
                evicting batch of every method, no host-device synchronisation in the eviction hooks and
                the step builder (``torch.cuda.set_sync_debug_mode("error")`` plus a check that every
                host-to-device copy there reads pinned memory), no Triton compile after start-up (vLLM's
                ``--jit-monitor-mode=error``), CriticalKV refused on an fp8 checkpoint;
* ``bench``     Llama-3.1-8B geometry, dummy weights, one vanilla engine and one eviction engine with the
                same KV memory (``bench`` subcommand): memory to spare (vanilla, eviction on but never
                evicting, evicting at budget 1,024) and 8k-token prompts that vanilla cannot all hold
                (throughput, concurrency reached, step time, eviction's share of it).

Device-only subcommands (``engine``, ``bench``) refuse to run without CUDA, loudly (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GIB = 1 << 30
# Llama-3.1-8B's shapes (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, llama3 RoPE).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
# SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads of 64): the small model of the engine checks.
SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
MODELS = {"small": SMALL, "llama8b": LLAMA_8B}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


# ---- prepare (no GPU): dummy-model folders --------------------------------------------------------
def tokenizer_source(explicit: str | None) -> Path:
    """The folder whose tokenizer the dummy models use: ``explicit``, else SmolLM2's converted folder."""
    if explicit:
        return Path(explicit)
    from vllm_evict.models import prepare

    return Path(prepare("smollm2-135m-instruct"))


def build_model_dirs(out: Path, tokenizer: Path) -> dict[str, Path]:
    """``out/<name>``: config.json of each geometry (vocab and special tokens from the tokenizer's own
    config) plus the tokenizer files; no weights (vLLM's ``load_format="dummy"``)."""
    source = json.loads((tokenizer / "config.json").read_text())
    vocab = int(source["vocab_size"])
    made = {}
    for name, shape in MODELS.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        config = {**shape, "vocab_size": vocab, "bos_token_id": source.get("bos_token_id"),
                  "eos_token_id": source.get("eos_token_id")}
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        copied = [f for f in TOKENIZER_FILES if (tokenizer / f).exists()]
        if "tokenizer.json" not in copied and "vocab.json" not in copied:
            raise FileNotFoundError(f"{tokenizer} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        for f in copied:
            shutil.copyfile(tokenizer / f, folder / f)
        made[name] = folder
    return made


# ---- the plan --------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    what: str
    estimate_s: int  # skipped when less time than this is left
    timeout_s: int
    command: list[str] = field(default_factory=list)


def plan(args: argparse.Namespace) -> list[Phase]:
    py, me, out = sys.executable, str(Path(__file__).resolve()), Path(args.out)
    models = Path(args.models)
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    phases = {
        "env": Phase("env", "GPU, versions, CUDA extension build, kernels per operation", 20, 240,
                     [py, me, "env", "--json", str(out / "env.json")]),
        "kernels": Phase("kernels", "tests/kernels on CUDA: CUDA and compiled Triton kernels vs the references",
                         90, 240, [*pytest, "tests/kernels", "-m", "gpu", "--junitxml", str(out / "kernels.xml")]),
        "contract": Phase("contract", "host contract and CLI flags with the GPU present", 30, 180,
                          [*pytest, "tests/test_host_contract.py", "tests/test_cli_flags.py",
                           "--junitxml", str(out / "contract.xml")]),
        "engine": Phase("engine", "bf16 + FA3 + piecewise CUDA graphs on the small dummy model: exactness, "
                        "page bounds, zero syncs, no compile after start-up, fp8 refusal", 150, 330,
                        [py, me, "engine", "--model", str(models / "small"), "--json", str(out / "engine.json")]),
        "bench": Phase("bench", "Llama-3.1-8B geometry, vanilla vs eviction: memory to spare; 8k prompts at "
                       "budget 1,024 with equal KV memory", 270, 420,
                       [py, me, "bench", "--model", str(models / "llama8b"), "--json", str(out / "bench.json"),
                        "--kv-gib", str(args.kv_gib), "--requests-8k", str(args.requests_8k)]),
    }
    names = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = [name for name in names if name not in phases]
    if unknown:
        raise SystemExit(f"unknown phase(s) {', '.join(unknown)}; phases: {', '.join(phases)}")
    return [phases[name] for name in names]


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    phases = plan(args)
    if args.dry_run:
        print(f"plan ({len(phases)} phases, deadline {args.deadline_s} s), results into {out}:")
        for phase in phases:
            print(f"  {phase.name:9s} ~{phase.estimate_s:4d} s (limit {phase.timeout_s} s)  {phase.what}")
            print(f"            $ {' '.join(phase.command)}")
        return 0
    require_cuda("run")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for phase in phases:
        left = args.deadline_s - (time.perf_counter() - start)
        if left < phase.estimate_s:
            reason = f"{left:.0f} s left, needs ~{phase.estimate_s}"
            results["phases"][phase.name] = {"status": "skipped", "reason": reason}
            continue
        began = time.perf_counter()
        print(f"[gpu] {phase.name}: {phase.what}", flush=True)
        try:
            proc = subprocess.run(phase.command, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=min(phase.timeout_s, max(left, 1)))
            status, tail, code = ("ok" if proc.returncode == 0 else "failed"), (proc.stdout + proc.stderr)[-6000:], \
                proc.returncode
        except subprocess.TimeoutExpired as exc:
            status, tail, code = "timeout", ((exc.stdout or b"").decode(errors="replace")
                                             + (exc.stderr or b"").decode(errors="replace"))[-6000:], None
        entry: dict[str, Any] = {"status": status, "exit": code, "seconds": round(time.perf_counter() - began, 1),
                                 "log_tail": tail}
        data = out / f"{phase.name}.json"
        if data.exists():
            entry["data"] = json.loads(data.read_text())
        results["phases"][phase.name] = entry
        print(f"[gpu] {phase.name}: {status} in {entry['seconds']} s", flush=True)
        write_report(results, out)
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_report(results, out)
    print((out / "results.md").read_text())
    return 0 if all(p["status"] in ("ok",) for p in results["phases"].values()) else 1


# ---- report ----------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/benchmarks/gpu.md from ``results.json``."""
    lines = [f"Run of {results.get('started', '?')} ({results.get('seconds', '?')} s in all).", "",
             "| phase | status | seconds |", "|---|---|---|"]
    phases = results.get("phases", {})
    for name, p in phases.items():
        reason = f": {p['reason']}" if p.get("reason") else ""
        lines.append(f"| {name} | {p['status']}{reason} | {p.get('seconds', '-')} |")
    env = phases.get("env", {}).get("data")
    if env:
        lines += ["", f"Device: {env.get('gpu')}; torch {env.get('torch')}, triton {env.get('triton')}, "
                      f"vLLM {env.get('vllm')}; CUDA extension: {env.get('cuda_extension')}; kernels per operation: "
                      + ", ".join(f"{k}={v}" for k, v in (env.get('kernels') or {}).items()) + "."]
    engine = phases.get("engine", {}).get("data")
    if engine:
        lines += ["", "| engine check (small dummy model, bf16, FA3, piecewise graphs) | result |", "|---|---|"]
        for check in engine.get("checks", []):
            lines.append(f"| {check['name']} | {'pass' if check['ok'] else 'FAIL'}: {check.get('detail', '')} |")
    bench = phases.get("bench", {}).get("data")
    if bench:
        lines += ["", "| scenario | variant | tok/s (all) | gen tok/s | vs vanilla | max running | step ms "
                      "(mean) | eviction share | preemptions |", "|---|---|---|---|---|---|---|---|---|"]
        for scenario in bench.get("scenarios", []):
            base = next((v for v in scenario["variants"] if v["name"] == "vanilla"), None)
            for v in scenario["variants"]:
                lines.append(
                    f"| {scenario['name']} | {v['name']} | {v['tokens_per_s']:.0f} | {v['generated_per_s']:.0f} | "
                    f"{_ratio(v['tokens_per_s'], base and base['tokens_per_s'])} | {v['max_running']} | "
                    f"{v['step_ms_mean']:.1f} | {v['eviction_share']:.1%} | {v['preemptions']} |")
        for note in bench.get("notes", []):
            lines.append(f"\n{note}")
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(markdown(results))


# ---- device-side phases ----------------------------------------------------------------------------
def require_cuda(what: str) -> None:
    """Device-only work fails loudly without a GPU instead of skipping."""
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py {what}: no CUDA device is visible; this needs the GPU machine "
              "(use --dry-run to see the plan)", file=sys.stderr)
        raise SystemExit(2)


def env_phase(args: argparse.Namespace) -> int:
    require_cuda("env")
    import torch
    import triton

    from vllm_evict import csrc, ops

    import vllm

    start = time.perf_counter()
    ext = csrc.load_extension()
    info = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "vllm": vllm.__version__, "nvcc": csrc.nvcc_path(), "nvcc_archs": list(csrc.nvcc_archs()),
            "cuda_extension": "built" if ext is not None else f"unavailable: {csrc.load_error()}",
            "cuda_extension_s": round(time.perf_counter() - start, 1), "kernels": ops.describe("cuda")}
    Path(args.json).write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the dummy-model folders (config + tokenizer)")
    p.add_argument("--out", default=".gpu/models")
    p.add_argument("--tokenizer", help="folder with tokenizer files and a config.json (default: SmolLM2's)")
    p = sub.add_parser("run", help="every phase, results into --out")
    p.add_argument("--models", default=".gpu/models")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    # engine and bench first: only a GPU can run them; the kernel tests can rerun alone (--phases kernels)
    p.add_argument("--phases", default="env,contract,engine,bench,kernels")
    p.add_argument("--deadline-s", type=int, default=570, help="skip phases that would not finish by then")
    p.add_argument("--kv-gib", type=float, default=20.0, help="KV memory of both bench engines")
    p.add_argument("--requests-8k", type=int, default=48, help="8k-token requests of the equal-memory scenario")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p = sub.add_parser("env")
    p.add_argument("--json", required=True)
    p = sub.add_parser("engine", help="(GPU) correctness of the engine on the small dummy model")
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p = sub.add_parser("bench", help="(GPU) vanilla vs eviction with Llama-3.1-8B geometry")
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--kv-gib", type=float, default=20.0)
    p.add_argument("--requests-8k", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="smaller batches (a smoke run)")
    p.add_argument("--full", action="store_true", help="also SnapKV in both scenarios, and with its decode windows accumulated in the first")
    p = sub.add_parser("report", help="results.json -> markdown")
    p.add_argument("results")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        made = build_model_dirs(Path(args.out), tokenizer_source(args.tokenizer))
        for name, folder in made.items():
            print(f"{name}: {folder}")
        return 0
    if args.command == "run":
        return run(args)
    if args.command == "env":
        return env_phase(args)
    if args.command == "report":
        print(markdown(json.loads(Path(args.results).read_text())))
        return 0
    require_cuda(args.command)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # The V1 runner unless the caller chooses (VLLM_USE_V2_MODEL_RUNNER=1 runs the same checks on Model
    # Runner V2): set here, in the GPU process, not when a test imports the engine module.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    import gpu_engine  # device-side code: vLLM and CUDA from here on

    if args.command == "engine":
        return gpu_engine.engine_checks(args.model, Path(args.json))
    return gpu_engine.bench(args.model, Path(args.json), kv_gib=args.kv_gib, requests_8k=args.requests_8k,
                            quick=args.quick, full=args.full)


if __name__ == "__main__":
    sys.exit(main())
