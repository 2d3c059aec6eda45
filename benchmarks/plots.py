"""The pictures of docs/observability.md, measured in the real vLLM engine on CPU and drawn with matplotlib.

    python benchmarks/plots.py              # SmolLM2-135M-Instruct: measure, write docs/img/*.png and the data
    python benchmarks/plots.py --tiny       # tiny random Llama: a quick run (to a temporary folder by default)
    python benchmarks/plots.py --replot     # redraw the PNGs from docs/img/plots.json without measuring
    make plots                              # the first command

Two measurements, each with and without eviction at the same KV pool (``--pool-pages`` pages of 32 tokens):

1. KV pages held over time: the same four requests (prompts of different lengths, submitted together) run
   in one engine without eviction and in one with ``--policy``/``--budget``; after every ``schedule()`` the
   pages each request holds are recorded (the step's allocation, before eviction gives any back).
2. Throughput against concurrency: for each concurrency C, a closed loop keeps C requests in flight
   (a new one starts when one finishes) until ``--requests`` have finished; throughput is generated tokens
   per second of wall time. Without eviction the pool limits how many requests run at once; with eviction
   each request holds at most budget + one chunk. The two engines take turns at each C.

The engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the scheduler can be read.
Timings depend on the machine and on its load: the page counts do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_evict.testing import use_offline_cpu_env  # noqa: E402

use_offline_cpu_env()

PAGE = 32
DOCS_IMG = REPO / "docs" / "img"
PAGES_PNG, THROUGHPUT_PNG, DATA_JSON = "kv_pages_over_time.png", "throughput_vs_concurrency.png", "plots.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    source.add_argument("--tiny", action="store_true", help="the tiny random Llama, for a quick run")
    parser.add_argument("--replot", action="store_true", help="only redraw the PNGs from the data file")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the PNGs and plots.json (default: docs/img; --tiny: a temporary folder)")
    parser.add_argument("--policy", default="keydiff", help="eviction policy (keydiff)")
    parser.add_argument("--budget", type=int, default=128, help="tokens kept per layer and KV head (128)")
    parser.add_argument("--pool-pages", type=int, default=64, help="KV pool of both engines, in pages (64)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk, max_num_batched_tokens (256)")
    parser.add_argument("--prompts", default="300,700,1100,1500", help="prompt lengths of the pages-over-time run")
    parser.add_argument("--gen-len", type=int, default=96, help="tokens generated per request (96)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="concurrencies of the throughput run (1,2,4,8)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt length of the throughput run (512)")
    parser.add_argument("--requests", type=int, default=16, help="requests per throughput point (16)")
    return parser.parse_args(argv)


def model_path(args: argparse.Namespace) -> tuple[str, str]:
    if args.model:
        return args.model, args.model
    if args.tiny:
        from vllm_evict.testing import build_tiny_llama

        return str(build_tiny_llama(Path(tempfile.gettempdir()) / "vllm-evict-plots-tiny-llama")), "tiny random Llama"
    from vllm_evict import models

    return str(models.prepare("smollm2-135m-instruct")), "SmolLM2-135M-Instruct"


def make_engine(model: str, eviction: dict[str, Any] | None, args: argparse.Namespace, max_num_seqs: int) -> Any:
    from vllm import LLM

    # max_model_len: the whole pool, so that vLLM's start-up check passes for the engine without eviction.
    kwargs: dict[str, Any] = dict(model=model, dtype="float32", enforce_eager=True,
                                  max_model_len=(args.pool_pages - 1) * PAGE,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=args.chunk, block_size=PAGE,
                                  num_gpu_blocks_override=args.pool_pages, kv_cache_memory_bytes=512 << 20, seed=0,
                                  enable_prefix_caching=False)
    if eviction is not None:
        kwargs["additional_config"] = {"kv_eviction": eviction}
    return LLM(**kwargs)


def prompt(length: int, offset: int, vocab: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(offset * 131 + 37 * i + (i * i) % 11) % vocab + 1 for i in range(length)]}


def params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def pages_held(scheduler: Any) -> dict[str, int]:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return {rid: len(blocks) for rid, blocks in manager.req_to_blocks.items() if blocks}


def shutdown(llm: Any) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# ---- 1. pages over time ------------------------------------------------------------------------------
def pages_over_time(model: str, eviction: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.prompts.split(",")]
    llm = make_engine(model, eviction, args, max_num_seqs=len(lengths))
    vocab = llm.llm_engine.model_config.get_vocab_size() - 10
    scheduler = scheduler_of(llm)
    trace: list[dict[str, int]] = []
    original = scheduler.schedule

    def schedule(*a: Any, **k: Any) -> Any:
        output = original(*a, **k)
        trace.append(pages_held(scheduler))
        return output

    scheduler.schedule = schedule
    engine = llm.llm_engine
    names = {}
    for index, length in enumerate(lengths):
        name = f"prompt {length}"
        names[str(index)] = name
        engine.add_request(str(index), prompt(length, index, vocab), params(args.gen_len))
    started = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.monotonic() - started
    shutdown(llm)
    # vLLM appends a suffix to request ids: map them back by their prefix.
    series: dict[str, list[int]] = {name: [] for name in names.values()}
    for step in trace:
        held = {rid.split("-", 1)[0]: n for rid, n in step.items()}
        for key, name in names.items():
            series[name].append(held.get(key, 0))
    return {"steps": len(trace), "seconds": seconds, "pages": series}


# ---- 2. throughput against concurrency ---------------------------------------------------------------
class ClosedLoop:
    """One engine that keeps ``level`` requests in flight until ``count`` have finished."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.engine, self.scheduler = llm, llm.llm_engine, scheduler_of(llm)
        self.vocab = self.engine.model_config.get_vocab_size() - 10
        self.preemptions = 0
        original = self.scheduler.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            output = original(*a, **k)
            self.preemptions += len(output.preempted_req_ids or ())
            return output

        self.scheduler.schedule = schedule
        self.run(1, 1, 64, 4, "warmup")

    def run(self, level: int, count: int, prompt_len: int, gen_len: int, tag: str) -> dict[str, Any]:
        submitted = finished = generated = most_running = 0
        self.preemptions = 0
        started = time.monotonic()
        while finished < count:
            while submitted < count and submitted - finished < level:
                self.engine.add_request(f"{tag}-{submitted}", prompt(prompt_len, submitted, self.vocab),
                                        params(gen_len))
                submitted += 1
            for out in self.engine.step():
                if out.finished:
                    finished += 1
                    generated += len(out.outputs[0].token_ids)
            most_running = max(most_running, len(self.scheduler.running))
        seconds = time.monotonic() - started
        return {"concurrency": level, "seconds": seconds, "generated": generated, "tokens_per_s": generated / seconds,
                "most_running": most_running, "preemptions": self.preemptions}


def throughput(model: str, eviction: dict[str, Any], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Both engines built up front and measured in turns at each concurrency, so that a busy spell of a
    shared machine hits both alike."""
    levels = [int(x) for x in args.concurrency.split(",")]
    loops = {"plain": ClosedLoop(make_engine(model, None, args, max(levels))),
             "evict": ClosedLoop(make_engine(model, eviction, args, max(levels)))}
    points: dict[str, list[dict[str, Any]]] = {key: [] for key in loops}
    for level in levels:
        for key, loop in loops.items():
            point = loop.run(level, args.requests, args.prompt_len, args.gen_len, f"{key}{level}")
            points[key].append(point)
            print(f"  {key} C={level}: {point['tokens_per_s']:.1f} tok/s, at most {point['most_running']} running, "
                  f"{point['preemptions']} preemptions", flush=True)
    for loop in loops.values():
        shutdown(loop.llm)
    return points


# ---- drawing -----------------------------------------------------------------------------------------
def draw(data: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = data["setup"]
    pool = setup["pool_pages"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, title in ((axes[0], "plain", "no eviction"),
                           (axes[1], "evict", f"{setup['policy']}, budget {setup['budget']}")):
        run = data["pages_over_time"][key]
        for name, series in run["pages"].items():
            ax.plot(range(len(series)), series, label=name, linewidth=1.5)
        ax.axhline(pool - 1, color="grey", linestyle="--", linewidth=1)
        ax.text(0, pool - 1, f" pool ({pool - 1} usable pages)", va="bottom", fontsize=8, color="grey")
        ax.set_title(f"{title}: {run['steps']} steps")
        ax.set_xlabel("engine step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"KV pages held ({PAGE} tokens each)")
    axes[1].legend(title="request", fontsize=8)
    fig.suptitle(f"KV pages per request over time, {setup['model']}, {setup['gen_len']} tokens generated each")
    fig.tight_layout()
    pages_png = out / PAGES_PNG
    fig.savefig(pages_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("plain", "no eviction"), ("evict", f"{setup['policy']}, budget {setup['budget']}")):
        points = data["throughput"][key]
        ax.plot([p["concurrency"] for p in points], [p["tokens_per_s"] for p in points], marker="o", label=label)
        for p in points:
            ax.annotate(str(p["most_running"]), (p["concurrency"], p["tokens_per_s"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (concurrency)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Throughput at equal KV memory ({pool} pages), {setup['model']}\n"
                 f"prompt {setup['prompt_len']}, generate {setup['gen_len']}; labels: most requests running at once",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    throughput_png = out / THROUGHPUT_PNG
    fig.savefig(throughput_png, dpi=110)
    plt.close(fig)
    return [pages_png, throughput_png]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or (Path(tempfile.mkdtemp(prefix="vllm-evict-plots-")) if args.tiny else DOCS_IMG)
    out.mkdir(parents=True, exist_ok=True)
    data_file = out / DATA_JSON
    if args.replot:
        data = json.loads(data_file.read_text())
    else:
        import torch
        import vllm

        model, label = model_path(args)
        eviction = {"policy": args.policy, "budget": args.budget}
        data = {"setup": {"model": label, "policy": args.policy, "budget": args.budget, "pool_pages": args.pool_pages,
                          "chunk": args.chunk, "gen_len": args.gen_len, "prompt_len": args.prompt_len,
                          "requests": args.requests, "command": " ".join(["python benchmarks/plots.py", *(argv or [])]),
                          "vllm": vllm.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
                          "machine": platform.machine(), "load_average": list(os.getloadavg())},
                "pages_over_time": {}, "throughput": {}}
        for key, config in (("plain", None), ("evict", eviction)):
            print(f"pages over time, {key}", flush=True)
            data["pages_over_time"][key] = pages_over_time(model, config, args)
        print("throughput against concurrency", flush=True)
        data["throughput"] = throughput(model, eviction, args)
        data["setup"]["load_average_after"] = list(os.getloadavg())
        data_file.write_text(json.dumps(data, indent=1))
    for path in draw(data, out):
        print(f"wrote {path}")
    print(f"data: {data_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
