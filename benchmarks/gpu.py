"""vllm-evict on a GPU: kernels, host contract, the engine's correctness in bf16 with FA3 and vLLM's default CUDA
graphs on both model runners with async scheduling, and vanilla vs eviction with Llama-3.1-8B geometry.

    python benchmarks/gpu.py prepare --out .gpu/models          # here: dummy-model folders (config + tokenizer)
    python benchmarks/gpu.py run --models .gpu/models --out DIR  # on the GPU machine (benchmarks/gpu_run.sh)
    python benchmarks/gpu.py run --dry-run                       # anywhere: the plan, phase by phase

``run`` executes its phases in order, each in a subprocess with its own time limit: one engine per process
(an engine's weights stay on the GPU after it is closed, so a second engine in the same process would not
start), and a hung phase cannot take the others down. Every figure goes to a file in ``--out`` as it is
measured (``<phase>.jsonl``, one JSON object a line, appended and flushed), and ``results.json`` and
``results.md`` are rewritten after every phase: what finished survives a machine taken back. A phase is
skipped, and says so, when the time left (``--deadline-s``) is below its estimate. The phases, in order of
value (``--phases`` takes phase names or the groups ``engine``, ``bench``, ``bench-v2``, ``bench-v2-8k``, ...):

* ``env``              GPU, versions, the CUDA extension's build and the kernels each operation uses;
* ``engine-vanilla``   the small dummy model without the plugin (V2, async scheduling): the reference greedy
                       tokens for the exactness check; CriticalKV refused on an fp8 checkpoint;
* ``engine-v2``        the small model with eviction on Model Runner V2 (vLLM's default), async scheduling
                       on (``engine`` subcommand): a budget above every length gives vanilla's greedy tokens
                       (and the tokens of the same engine with eviction off per request); every method evicts
                       in prefill and decode with every request's pages within its bound; no host-device
                       synchronisation in the eviction hooks, the step builder and the row bookkeeping
                       (``torch.cuda.set_sync_debug_mode``) and no copy there from pageable memory; no
                       eviction kernel compiled after start-up, and no "JIT compilation during inference"
                       from vLLM's JIT monitor for them;
* ``engine-v1``        the same on the V1 runner (against the same engine with eviction off per request);
* ``bench-v2-8k-vanilla``, ``bench-v2-8k-eviction``  Llama-3.1-8B geometry, dummy weights, the same KV
                       memory, async scheduling on both sides, Model Runner V2: 8k-token prompts that vanilla
                       cannot all hold, eviction at budget 1,024 (chunked);
* ``bench-v2-spare-vanilla``, ``bench-v2-spare-eviction``  memory to spare: vanilla; eviction on but never
                       evicting, and evicting at budget 1,024;
* ``kernels``          ``pytest tests/kernels tests/policies -m gpu``: every kernel on CUDA (CUDA extension,
                       compiled Triton) against the PyTorch references, and the policies on CUDA tensors;
* ``bench-v1-8k-*``, ``bench-v1-spare-*``  the benchmark again on the V1 runner;
* ``contract``         ``pytest tests/test_host_contract.py tests/test_cli_flags.py`` with the GPU present.

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
RUNNERS = {"v2": "1", "v1": "0"}  # --runner -> VLLM_USE_V2_MODEL_RUNNER
# The test paths of the kernels phase: every test marked ``gpu`` lives under one of them
# (tests/test_gpu_script.py checks it).
GPU_TEST_PATHS = ("tests/kernels", "tests/policies")
SCENARIOS = ("8k", "spare")  # in order of value: the equal-memory 8k comparison first
BENCH = [f"bench-{runner}-{scenario}-{side}" for runner in ("v2", "v1") for scenario in SCENARIOS
         for side in ("vanilla", "eviction")]
GROUPS = {"engine": ("engine-vanilla", "engine-v2", "engine-v1"), "bench": tuple(BENCH),
          **{f"bench-{r}": tuple(b for b in BENCH if b.startswith(f"bench-{r}-")) for r in ("v2", "v1")},
          **{f"bench-{r}-{s}": tuple(b for b in BENCH if b.startswith(f"bench-{r}-{s}-")) for r in ("v2", "v1")
             for s in SCENARIOS}}
CAPACITY = ["capacity-eviction", "capacity-vanilla"]
GROUPS["fp8"] = ("engine-fp8", "capacity-eviction", "kernels-fp8", "capacity-vanilla")
DEFAULT_PHASES = ("env,engine,bench-v2-8k,bench-v2-spare,kernels,kernel-times,bench-v1-8k,bench-v1-spare,contract,"
                  "fp8")


@dataclass
class Phase:
    name: str
    what: str
    estimate_s: int  # skipped when less time than this is left
    timeout_s: int
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the run's environment


def plan(args: argparse.Namespace) -> list[Phase]:
    py, me, out = sys.executable, str(Path(__file__).resolve()), Path(args.out)
    models = Path(args.models)
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    small, big = str(models / "small"), str(models / "llama8b")

    def engine(runner: str, vanilla: bool) -> list[str]:
        name = "engine-vanilla" if vanilla else f"engine-{runner}"
        command = [py, me, "engine", "--model", small, "--runner", runner, "--out", str(out), "--name", name]
        return command + (["--vanilla"] if vanilla else ["--reference", str(out / "engine-vanilla.tokens.json")])

    def bench(runner: str, scenario: str, side: str) -> list[str]:
        return [py, me, "bench", "--model", big, "--runner", runner, "--scenario", scenario, "--side", side,
                "--out", str(out), "--name", f"bench-{runner}-{scenario}-{side}", "--kv-gib", str(args.kv_gib),
                "--requests-8k", str(args.requests_8k), *(["--full"] if args.full else [])]

    bench_what = {"8k": "Llama-3.1-8B geometry, {side}, {runner}, async, {kv} GiB of KV: {n} x 8k prompts "
                        "(eviction: budget 1,024, chunked)",
                  "spare": "Llama-3.1-8B geometry, {side}, {runner}, async, {kv} GiB of KV: memory to spare "
                           "(eviction: never evicting, budget 1,024)"}
    phases = {
        "env": Phase("env", "GPU, versions, CUDA extension build, kernels per operation", 30, 240,
                     [py, me, "env", "--json", str(out / "env.json")]),
        "engine-vanilla": Phase("engine-vanilla", "small dummy model without the plugin (V2, async): reference "
                                "tokens; CriticalKV refused on fp8", 50, 240, engine("v2", True), {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        "engine-v2": Phase("engine-v2", "bf16 + FA3 + vLLM's CUDA graphs (full where no layer evicts), Model Runner V2, async: exactness, "
                           "page bounds, zero syncs, no compile after start-up", 90, 330, engine("v2", False),
                           {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        "engine-v1": Phase("engine-v1", "the same on the V1 runner", 70, 330, engine("v1", False),
                           {"VLLM_USE_V2_MODEL_RUNNER": "0"}),
        "kernels": Phase("kernels", "every kernel and the policies on CUDA against the PyTorch references", 90, 300,
                         [*pytest, *GPU_TEST_PATHS, "-m", "gpu", "--continue-on-collection-errors",
                          "--junitxml", str(out / "kernels.xml")]),
        "kernel-times": Phase("kernel-times", "benchmarks/kernels.py: every eviction kernel timed (the window pass "
                              "and its softmax, also added into the paged state; KeyDiff, CAOTE, compaction) and "
                              "the per-layer step beside attention", 60, 240,
                              [py, str(Path(me).parent / "kernels.py"), "--out", str(out / "kernels.md")]),
        "engine-fp8": Phase("engine-fp8", "the engine checks of engine-v2 over FA3's fp8 KV cache (#29): every method "
                            "evicts, page bounds, zero syncs, no compile after start-up, exact against eviction off",
                            90, 330, [py, me, "engine", "--model", small, "--runner", "v2", "--out", str(out),
                                      "--name", "engine-fp8", "--kv-cache-dtype", "fp8"],
                            {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
        "kernels-fp8": Phase("kernels-fp8", "the fp8 kernel tests on CUDA (Triton and the CUDA extension) against the "
                             "PyTorch references", 40, 200,
                             [*pytest, "tests/kernels/test_fp8.py", "-m", "gpu", "--junitxml", str(out / "kernels-fp8.xml")]),
        "contract": Phase("contract", "host contract and CLI flags with the GPU present", 30, 180,
                          [*pytest, "tests/test_host_contract.py", "tests/test_cli_flags.py",
                           "--junitxml", str(out / "contract.xml")]),
    }
    for name in CAPACITY:
        side = name.split("-")[1]
        phases[name] = Phase(name, f"requests held at once at equal KV memory, {side}: fp8 then bf16, one engine "
                             "after the other (#29)", 100, 300,
                             [py, me, "capacity", "--model", small, "--out", str(out), "--name", name,
                              *(["--eviction"] if side == "eviction" else [])], {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    for name in BENCH:
        _, runner, scenario, side = name.split("-")
        what = bench_what[scenario].format(side=side, runner=runner, kv=args.kv_gib, n=args.requests_8k)
        phases[name] = Phase(name, what, 110 if side == "vanilla" else 130, 400, bench(runner, scenario, side),
                             {"VLLM_USE_V2_MODEL_RUNNER": RUNNERS[runner]})
    names: list[str] = []
    for name in (n.strip() for n in args.phases.split(",") if n.strip()):
        names += [n for n in GROUPS.get(name, (name,)) if n not in names]
    unknown = [name for name in names if name not in phases]
    if unknown:
        raise SystemExit(f"unknown phase(s) {', '.join(unknown)}; phases: {', '.join(phases)}; groups: "
                         f"{', '.join(GROUPS)}")
    return [phases[name] for name in names]


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    phases = plan(args)
    if args.dry_run:
        print(f"plan ({len(phases)} phases, deadline {args.deadline_s} s), results into {out}:")
        for phase in phases:
            env = " ".join(f"{k}={v}" for k, v in phase.env.items())
            print(f"  {phase.name:22s} ~{phase.estimate_s:4d} s (limit {phase.timeout_s} s)  {phase.what}")
            print(f"            $ {env + ' ' if env else ''}{' '.join(phase.command)}")
        return 0
    require_cuda("run")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "phases": {}}
    start = time.perf_counter()
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = Path(args.done) if args.done else None
    for phase in phases:
        earlier = reuse(phase.name, done, out)
        if earlier is not None:
            results["phases"][phase.name] = earlier
            write_report(results, out)
            continue
        left = args.deadline_s - (time.perf_counter() - start)
        if left < phase.estimate_s:
            results["phases"][phase.name] = {"status": "skipped", "reason": f"{left:.0f} s left, needs ~{phase.estimate_s}"}
            write_report(results, out)
            continue
        began = time.perf_counter()
        print(f"[gpu] {phase.name}: {phase.what}", flush=True)
        log = out / f"{phase.name}.log"
        with log.open("w") as sink:  # the whole output, as it comes (not only a tail at the end)
            try:
                proc = subprocess.run(phase.command, cwd=REPO, env={**base, **phase.env}, stdout=sink,
                                      stderr=subprocess.STDOUT, timeout=min(phase.timeout_s, max(left, 1)))
                status, code = ("ok" if proc.returncode == 0 else "failed"), proc.returncode
            except subprocess.TimeoutExpired:
                status, code = "timeout", None
        entry: dict[str, Any] = {"status": status, "exit": code, "seconds": round(time.perf_counter() - began, 1),
                                 "log_tail": log.read_text(errors="replace")[-3000:]}
        data = out / f"{phase.name}.json"
        if data.exists():
            entry["data"] = json.loads(data.read_text())
        elif (out / f"{phase.name}.jsonl").exists():  # cut short: what it measured before
            entry["data"] = {"records": read_records(out / f"{phase.name}.jsonl")}
        results["phases"][phase.name] = entry
        print(f"[gpu] {phase.name}: {status} in {entry['seconds']} s", flush=True)
        write_report(results, out)
        if status == "ok" and done is not None:
            keep(phase.name, entry, out, done)
    results["seconds"] = round(time.perf_counter() - start, 1)
    write_report(results, out)
    print((out / "results.md").read_text())
    return 0 if all(p["status"] == "ok" for p in results["phases"].values()) else 1


def phase_files(name: str, folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob(f"{name}.*") if p.is_file())


def keep(name: str, entry: dict[str, Any], out: Path, done: Path) -> None:
    """A phase that passed: its files and its entry, for later calls on this machine (``reuse``)."""
    folder = done / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in phase_files(name, out):
        shutil.copy2(path, folder / path.name)
    (folder / "entry.json").write_text(json.dumps(entry, default=str))


def reuse(name: str, done: Path | None, out: Path) -> dict[str, Any] | None:
    """The entry of a phase that passed in an earlier call (its files copied into ``out``), or None."""
    entry_file = done / name / "entry.json" if done is not None else None
    if entry_file is None or not entry_file.exists():
        return None
    for path in phase_files(name, entry_file.parent):
        shutil.copy2(path, out / path.name)
    entry = json.loads(entry_file.read_text())
    print(f"[gpu] {name}: passed in an earlier call on this machine, not run again", flush=True)
    return {**entry, "status": "ok", "reused": True}


# ---- figures as they are measured ------------------------------------------------------------------
class Records:
    """``<out>/<name>.jsonl``: one JSON object a line, appended and flushed as each figure is measured, so
    that a phase cut short (a timeout, a machine taken back) leaves what it had; ``finish`` writes the
    phase's summary to ``<out>/<name>.json``."""

    def __init__(self, out: Path, name: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.summary = out / f"{name}.jsonl", out / f"{name}.json"
        self.path.write_text("")

    def add(self, kind: str, **figures: Any) -> dict[str, Any]:
        record = {"kind": kind, **figures}
        with self.path.open("a") as sink:
            sink.write(json.dumps(record, default=str) + "\n")
            sink.flush()
            os.fsync(sink.fileno())
        print(f"[{kind}] {json.dumps(figures, default=str)}", flush=True)
        return record

    def finish(self, **summary: Any) -> None:
        self.summary.write_text(json.dumps({**summary, "records": read_records(self.path)}, indent=1, default=str))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``Records`` file (a last line cut mid-write is left out)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


# ---- report ----------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


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
    checks = [(name, r) for name, p in phases.items() if name.startswith("engine")
              for r in (p.get("data") or {}).get("records", []) if r.get("kind") == "check"]
    if checks:
        lines += ["", "| engine check (small dummy model, bf16, FA3, vLLM's default CUDA graphs, async scheduling) | phase | "
                      "result |", "|---|---|---|"]
        for name, check in checks:
            lines.append(f"| {check['name']} | {name} | {'pass' if check['ok'] else 'FAIL'}: {check.get('detail', '')} |")
    measured = [(name, r) for name, p in phases.items() if name.startswith("bench")
                for r in (p.get("data") or {}).get("records", []) if r.get("kind") == "measure"]
    if measured:
        lines += ["", "| runner | scenario | variant | tok/s (all) | gen tok/s | vs vanilla | max running | step ms "
                      "(mean) | eviction share | of a prefill chunk | of a decode step | preemptions |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        vanilla = {(r["runner"], r["scenario"]): r for _, r in measured if r["variant"] == "vanilla"}
        for _, r in measured:
            base = vanilla.get((r["runner"], r["scenario"]))
            lines.append(
                f"| {r['runner']} | {r['scenario']} | {r['variant']} | {r['tokens_per_s']:.0f} | "
                f"{r['generated_per_s']:.0f} | {_ratio(r['tokens_per_s'], base and base['tokens_per_s'])} | "
                f"{r['max_running']} | {r['step_ms_mean']:.1f} | {_share(r.get('eviction_share'))} | "
                f"{_share(r.get('prefill_chunk_eviction_share'))} | {_share(r.get('decode_hook_share'))} | "
                f"{r['preemptions']} |")
        notes = sorted({n for name, p in phases.items() if name.startswith("bench")
                        for n in (p.get("data") or {}).get("notes", [])})
        lines += [f"\n{note}" for note in notes]
    held = [r for name, p in phases.items() if name.startswith("capacity")
            for r in (p.get("data") or {}).get("records", []) if r.get("kind") == "measure"]
    if held:
        lines += ["", "| fp8 capacity: variant | KV pages | max running | tok/s (all) | preemptions |", "|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['pages']} | {r['max_running']} | {r['tokens_per_s']:.0f} | {r['preemptions']} |"
                  for r in held]
        by = {(r["eviction"], r["kv_cache_dtype"]): r for r in held}
        for side in (True, False):
            fp8, bf16 = by.get((side, "fp8")), by.get((side, "auto"))
            if fp8 and bf16:
                lines.append(f"\n{'eviction' if side else 'vanilla'}: fp8 holds "
                             f"{_ratio(fp8['max_running'], bf16['max_running'])} the requests of bf16 at once "
                             f"({_ratio(fp8['pages'], bf16['pages'])} the pages)")
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
    p = sub.add_parser("run", help="the phases, results into --out")
    p.add_argument("--models", default=".gpu/models")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    p.add_argument("--phases", default=DEFAULT_PHASES, help=f"phases or groups, in order (default {DEFAULT_PHASES})")
    p.add_argument("--deadline-s", type=int, default=540, help="skip phases that would not finish by then")
    p.add_argument("--kv-gib", type=float, default=20.0, help="KV memory of both bench engines")
    p.add_argument("--requests-8k", type=int, default=48, help="8k-token requests of the equal-memory scenario")
    p.add_argument("--full", action="store_true", help="the bench also measures SnapKV")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--done", default="/tmp/gpu-done", help="phases that passed, kept across calls on one machine: "
                   "not run again (their files are copied into --out); '' keeps none")
    p = sub.add_parser("env")
    p.add_argument("--json", required=True)
    for name, what in (("engine", "(GPU) correctness of the engine on the small dummy model, one engine"),
                       ("bench", "(GPU) one side of vanilla vs eviction with Llama-3.1-8B geometry, one engine")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--model", required=True)
        p.add_argument("--runner", choices=sorted(RUNNERS), default="v2")
        p.add_argument("--out", required=True, help="folder of the figures (<name>.jsonl, <name>.json)")
        p.add_argument("--name", required=True)
    p = sub.add_parser("capacity", help="(GPU) requests held at once at equal KV memory, one engine (#29)")
    p.add_argument("--model", required=True)
    p.add_argument("--runner", choices=sorted(RUNNERS), default="v2")
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--eviction", action="store_true")
    engine_parser = sub.choices["engine"]
    engine_parser.add_argument("--vanilla", action="store_true", help="the engine without the plugin (reference tokens)")
    engine_parser.add_argument("--kv-cache-dtype", default="auto", help="fp8: the checks over an fp8 KV cache")
    engine_parser.add_argument("--reference", help="the vanilla phase's tokens (<out>/engine-vanilla.tokens.json)")
    bench_parser = sub.choices["bench"]
    bench_parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    bench_parser.add_argument("--side", choices=("vanilla", "eviction"), required=True)
    bench_parser.add_argument("--kv-gib", type=float, default=20.0)
    bench_parser.add_argument("--requests-8k", type=int, default=48)
    bench_parser.add_argument("--quick", action="store_true", help="smaller batches (a smoke run)")
    bench_parser.add_argument("--full", action="store_true", help="also SnapKV in both scenarios")
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
    # The runner is chosen here, in the GPU process, before vLLM is imported (never when a test imports
    # the engine module: that would pick the runner for the whole test session).
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = RUNNERS[args.runner]
    import gpu_engine  # device-side code: vLLM and CUDA from here on

    records = Records(Path(args.out), args.name)
    if args.command == "engine":
        if args.vanilla:
            return gpu_engine.engine_vanilla(args.model, records, Path(args.out) / f"{args.name}.tokens.json")
        return gpu_engine.engine_checks(args.model, records, args.runner,
                                        Path(args.reference) if args.reference and args.kv_cache_dtype == "auto"
                                        else None, kv_cache_dtype=args.kv_cache_dtype)
    if args.command == "capacity":
        return gpu_engine.capacity(args.model, records, eviction=args.eviction)
    return gpu_engine.bench(args.model, records, runner=args.runner, scenario=args.scenario, side=args.side,
                            kv_gib=args.kv_gib, requests_8k=args.requests_8k, quick=args.quick, full=args.full)


if __name__ == "__main__":
    sys.exit(main())
