"""Long-context quality suite: synthetic tasks through the real engine and through NVIDIA kvpress.

    python -m benchmarks.quality run --backend engine --lengths 4096 --methods defaults   # the engine
    python -m benchmarks.quality run --backend kvpress --lengths 4096                     # kvpress, same samples
    python -m benchmarks.quality report                                                   # tables + plots
    python -m benchmarks.quality run --quick                                              # a small subset

Results go to one JSON-lines file (``--results``), appended after every batch: a killed run continues
where it stopped, and ``--dry-run`` says what is left and how many tokens that is. See
docs/benchmarks/quality.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.quality import methods as M
from benchmarks.quality.results import Store
from benchmarks.quality.tasks import TASKS

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "docs" / "benchmarks" / "quality"  # results-<backend>.jsonl: one file per backend
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
QUICK = dict(lengths="2048", samples=1, methods="quick", ratios="0.5,0.875")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or continue) the suite on one backend")
    run.add_argument("--backend", choices=("engine", "kvpress"), default="engine")
    run.add_argument("--model", default=DEFAULT_MODEL, help=f"a vllm_evict.models name or an HF folder ({DEFAULT_MODEL})")
    run.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    run.add_argument("--lengths", default="4096", help="comma-separated target lengths in tokens (4096)")
    run.add_argument("--tasks", default="all", help=f"comma-separated, or all: {', '.join(TASKS)}")
    run.add_argument("--samples", type=int, default=1, help="samples per task and length (1)")
    run.add_argument("--first-sample", type=int, default=0, help="index of the first sample (0)")
    run.add_argument("--methods", default="defaults",
                     help=f"a profile ({', '.join(M.PROFILES)}) or comma-separated method names (engine backend)")
    run.add_argument("--presses", default="all", help="comma-separated kvpress presses, or all (kvpress backend)")
    run.add_argument("--ratios", default=",".join(str(r) for r in M.RATIOS), help="compression ratios (fraction removed)")
    run.add_argument("--settings", default=",".join(M.SETTINGS), help="aware, agnostic or both")
    run.add_argument("--seed", type=int, default=0, help="task seed (0)")
    run.add_argument("--results", type=Path, default=None,
                     help="results file (default: docs/benchmarks/quality/results-<backend>.jsonl)")
    run.add_argument("--chunk", type=int, default=512, help="engine max_num_batched_tokens (512)")
    run.add_argument("--max-num-seqs", type=int, default=16, help="engine max_num_seqs (16)")
    run.add_argument("--kv-gib", type=float, default=2.0, help="engine KV pool in GiB (2)")
    run.add_argument("--quick", action="store_true",
                     help="shorthand for --lengths 2048 --samples 1 --methods quick --ratios 0.5,0.875")
    run.add_argument("--dry-run", action="store_true", help="print what is left to run, and run nothing")
    report = sub.add_parser("report", help="tables (markdown) and plots from a results file")
    report.add_argument("--results", type=Path, nargs="+", default=None,
                        help="results files (default: docs/benchmarks/quality/results-*.jsonl)")
    report.add_argument("--model", default=DEFAULT_MODEL)
    report.add_argument("--dtype", default="bfloat16")
    report.add_argument("--length", type=int, default=4096)
    report.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for results.md and the PNGs")
    args = parser.parse_args(argv)
    if args.command == "run" and args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def resolve_model(name: str) -> str:
    if Path(name).is_dir():
        return str(Path(name).resolve())
    from vllm_evict import models

    return str(models.prepare(name))


def method_list(spec: str) -> list[M.Method]:
    names = M.PROFILES.get(spec) or tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in M.ALL_METHODS]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]!r}; methods: {', '.join(M.ALL_METHODS)}; "
                         f"profiles: {', '.join(M.PROFILES)}")
    return [M.ALL_METHODS[n] for n in names]


def environment() -> dict[str, Any]:
    import torch

    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return {"python": platform.python_version(), "torch": torch.__version__, "cpu_isa": isa,
            "machine": platform.machine(), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "report":
        from benchmarks.quality import report

        files = args.results or sorted(RESULTS_DIR.glob("results-*.jsonl"))
        out = report.write(files, model=Path(args.model).name, dtype=args.dtype, length=args.length, out=args.out)
        print(f"wrote {out}")
        return 0
    return run(args)


def run(args: argparse.Namespace) -> int:
    from benchmarks.quality import prompts as P

    lengths = [int(x) for x in args.lengths.split(",")]
    task_names = list(TASKS) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",")]
    bad = [t for t in task_names if t not in TASKS]
    if bad:
        raise SystemExit(f"unknown task {bad[0]!r}; tasks: {', '.join(TASKS)}")
    ratios = [float(x) for x in args.ratios.split(",")]
    settings = [s.strip() for s in args.settings.split(",")]
    if any(s not in M.SETTINGS for s in settings):
        raise SystemExit(f"settings are {', '.join(M.SETTINGS)}")
    if args.results is None:
        args.results = RESULTS_DIR / f"results-{args.backend}.jsonl"
    model_path = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    store = Store(args.results)
    base = {"model": Path(args.model).name, "dtype": args.dtype, "seed": args.seed}
    indices = range(args.first_sample, args.first_sample + args.samples)
    prompts = [P.fit(tokenizer, task, length, index, args.seed) for length in lengths
               for task in task_names for index in indices]
    if args.backend == "engine":
        return run_engine(args, model_path, prompts, settings, ratios, store, base)
    return run_kvpress(args, model_path, prompts, settings, ratios, store, base)


def _key(base: dict[str, Any], backend: str, prompt: Any, setting: str, method: str, ratio: float) -> tuple:
    s = prompt.sample
    return (backend, base["model"], base["dtype"], setting, s.length, s.task, s.index, method, ratio)


def run_engine(args: argparse.Namespace, model_path: str, prompts: list, settings: list[str], ratios: list[float],
               store: Store, base: dict[str, Any]) -> int:
    from benchmarks.quality import engine_runner as E

    chosen = method_list(args.methods)
    units = []  # (prompt, setting, [requests])
    for prompt in prompts:
        for setting in settings:
            requests = []
            for method in chosen:
                if setting not in method.settings:
                    continue
                for ratio in ([0.0] if method.spec is None else ratios):
                    if store.done(_key(base, "engine", prompt, setting, method.name, ratio)):
                        continue
                    request = E.requests_for(prompt, setting, method, ratio)
                    request.base = dict(base)
                    requests.append(request)
            if requests:
                units.append((prompt, setting, requests))
    tokens = sum(len(r.prompt_ids) + r.max_tokens for _, _, rs in units for r in rs)
    count = sum(len(rs) for _, _, rs in units)
    print(f"engine: {count} requests left in {len(units)} batches, {tokens:,} tokens "
          f"(prompt + generated); results: {args.results}", flush=True)
    if args.dry_run or not units:
        return 0
    from tqdm import tqdm

    max_len = max(p.num_tokens + p.sample.max_new_tokens for p, _, _ in units) + 64
    llm = E.make_llm(model_path, dtype=args.dtype, max_model_len=max_len, chunk=args.chunk,
                     max_num_seqs=args.max_num_seqs, kv_bytes=int(args.kv_gib * (1 << 30)))
    eos = E.eos_ids(llm.get_tokenizer(), model_path)
    header = {"environment": environment(), "engine": {"chunk": args.chunk, "max_num_seqs": args.max_num_seqs}}
    with tqdm(total=tokens, unit="tok", unit_scale=True, desc="engine", smoothing=0.1) as bar:
        for prompt, setting, requests in units:
            bar.set_postfix_str(f"{prompt.sample.sample_id} {setting} ({len(requests)} requests)")
            start = time.monotonic()
            records = E.run(llm, requests, eos, use_tqdm=False)
            for r in records:
                r.update(header)
            store.add(records)
            bar.update(sum(len(r.prompt_ids) + r.max_tokens for r in requests))
            done = [r for r in records if r["score"] is not None]
            bar.write(f"{prompt.sample.sample_id} {setting}: {len(records)} records in "
                      f"{time.monotonic() - start:.0f} s, mean score {_mean(done):.2f}")
    return 0


def _mean(records: list[dict[str, Any]]) -> float:
    return sum(r["score"] for r in records) / len(records) if records else float("nan")


def run_kvpress(args: argparse.Namespace, model_path: str, prompts: list, settings: list[str], ratios: list[float],
                store: Store, base: dict[str, Any]) -> int:
    import torch

    from benchmarks.quality import kvpress_runner as K
    from benchmarks.quality.engine_runner import eos_ids

    every = M.presses()
    names = list(every) if args.presses == "all" else [n.strip() for n in args.presses.split(",")]
    bad = [n for n in names if n not in every]
    if bad:
        raise SystemExit(f"unknown press {bad[0]!r}; presses: {', '.join(every)}")
    units = []
    for prompt in prompts:
        for setting in settings:
            todo = {n: every[n] for n in names
                    if any(not store.done(_key(base, "kvpress", prompt, setting, n, r)) for r in ratios)}
            full = not store.done(_key(base, "kvpress", prompt, setting, "full", 0.0))
            if todo or full:
                units.append((prompt, setting, todo, full))
    print(f"kvpress: {len(units)} prefills left (each with its presses' decodes); results: {args.results}", flush=True)
    if args.dry_run or not units:
        return 0
    from tqdm import tqdm

    model, tokenizer = K.load(model_path, getattr(torch, args.dtype))
    eos = eos_ids(tokenizer, model_path)
    header = {"environment": environment(), "kvpress": _kvpress_version()}
    for prompt, setting, todo, full in tqdm(units, desc="kvpress", unit="prefill"):
        records = K.run(model, tokenizer, prompt, setting, todo, ratios, eos, full, dict(base))
        for r in records:
            r.update(header)
        store.add(records)
        tqdm.write(f"{prompt.sample.sample_id} {setting}: {len(records)} records, mean score {_mean(records):.2f}")
    return 0


def _kvpress_version() -> str:
    from importlib.metadata import version

    return version("kvpress")


if __name__ == "__main__":
    sys.exit(main())
