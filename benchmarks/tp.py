"""TP=1 vs TP=2 with KV eviction, in the real vLLM engine on CPU, in one run.

    python benchmarks/tp.py                          # tiny random Llama (8 query heads, 4 KV heads)
    python benchmarks/tp.py --kv-heads 1 --policy h2o   # 1 KV head: copied on both ranks, group sums all-reduced
    python benchmarks/tp.py --model PATH --policy caote+snapkv --budget 128 --prompt-len 1024

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0). Three engines serve the same
prompts (random token ids, one request at a time) with the same eviction settings, one after the other,
each after one warm-up request:

- TP 1 with one PyTorch thread per allowed core (the worker runs in this process);
- TP 1 with one thread;
- TP 2: two worker processes (vLLM's multiprocess executor), each bound to its own core, one thread each.

Per prompt:

- prefill = wall time of a request with max_tokens=1 (time to first token);
- decode  = (wall time of the same prompt with max_tokens=N - prefill) / (N - 1), per token;
- pages   = the most KV pages the scheduler held for the request at any step.

On a machine with 2 cores this measures what TP costs (a second process, an all-reduce per layer, the
eviction hooks on each rank), not a speed-up: TP 1 already uses both cores through intra-op threads.
Times are the median and the minimum over --repeats prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder whose query and KV heads split over 2 "
                                                      "ranks (default: a tiny random Llama, 8/4 heads)")
    parser.add_argument("--kv-heads", type=int, default=4, choices=(1, 2, 4, 8),
                        help="KV heads of the tiny model (8 query heads); 1: each rank holds a copy of the KV head "
                             "and half its query heads, so every group sum is all-reduced (default: 4)")
    parser.add_argument("--policy", default="snapkv", help="eviction policy [META+]BASE (default: snapkv)")
    parser.add_argument("--budget", type=int, default=64, help="tokens kept per sequence, layer and KV head (64)")
    parser.add_argument("--eviction-config", type=json.loads, default=None, metavar="JSON",
                        help='more eviction options, e.g. \'{"schedule": "chunked"}\'')
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (512)")
    parser.add_argument("--gen-len", type=int, default=32, help="generated tokens N for the decode timing (32)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts timed per engine (3)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="prefill chunk (256)")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache per rank, MiB (64)")
    parser.add_argument("--dtype", default="float32")
    return parser.parse_args(argv)


def omp_bind(ranks: int) -> str:
    """One core per rank when there are enough (threads of both ranks floating over the same cores make a
    TP 2 step several times slower); otherwise no binding."""
    cores = sorted(os.sched_getaffinity(0))
    if ranks < 2 or len(cores) < ranks:
        return "nobind"
    per_rank = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * per_rank:(r + 1) * per_rank])) for r in range(ranks))


# vLLM's CPU worker turns torch.set_num_threads into a no-op in the process it runs in; keep the real one.
_set_num_threads = torch.set_num_threads
CONFIGS = [("TP 1, all cores", 1, None), ("TP 1, 1 thread", 1, 1), ("TP 2, 1 core each", 2, None)]


def make_engine(args: argparse.Namespace, model: str, tp: int, threads: int | None) -> Any:
    from vllm import LLM

    _set_num_threads(threads or len(os.sched_getaffinity(0)))  # the in-process worker's threads (TP 1)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind(tp)  # read when the worker processes start
    eviction = {"policy": args.policy, "budget": args.budget, **(args.eviction_config or {})}
    return LLM(model=model, dtype=args.dtype, enforce_eager=True, max_model_len=args.prompt_len + args.gen_len + 64,
               max_num_seqs=1, max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               kv_cache_memory_bytes=args.kv_cache_mb << 20, seed=0, enable_prefix_caching=False,
               tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
               additional_config={"kv_eviction": eviction})


def timed_request(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """Wall time of one request stepped to completion, and the most pages it held after any schedule()."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    peak = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        for request_id in scheduler.requests:
            peak = max(peak, len(scheduler.kv_cache_manager.coordinator.single_type_managers[0]
                                 .req_to_blocks.get(request_id, ())))
    return time.perf_counter() - start, peak


def measure(args: argparse.Namespace, model: str, tp: int, threads: int | None,
            prompts: list[list[int]]) -> dict[str, list[float]]:
    llm = make_engine(args, model, tp, threads)
    try:
        timed_request(llm, prompts[0], 2)  # warm-up
        result: dict[str, list[float]] = {"prefill": [], "decode": [], "pages": []}
        for prompt in prompts[1:]:
            prefill, _ = timed_request(llm, prompt, 1)
            total, pages = timed_request(llm, prompt, args.gen_len)
            result["prefill"].append(prefill)
            result["decode"].append((total - prefill) / (args.gen_len - 1))
            result["pages"].append(pages)
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import random

    model = args.model
    if model is None:
        from vllm_evict.testing import build_tiny_llama

        folder = Path(tempfile.gettempdir()) / f"vllm-evict-bench-tp-llama-kv{args.kv_heads}"
        model = str(build_tiny_llama(folder, heads=8, kv_heads=args.kv_heads, init_std=0.2))
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(args.prompt_len)] for _ in range(args.repeats + 1)]
    results = {name: measure(args, model, tp, threads, prompts) for name, tp, threads in CONFIGS}

    print(f"\nmodel {model}; {args.policy} budget {args.budget}; prompt {args.prompt_len}, decode {args.gen_len} "
          f"tokens; {args.repeats} prompts; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}")
    print(f"{'engine':<18} | {'prefill ms (median / min)':>26} | {'decode ms/token (median / min)':>31} | peak pages")
    for name, r in results.items():
        print(f"{name:<18} | {statistics.median(r['prefill']) * 1e3:>12.1f} / {min(r['prefill']) * 1e3:>11.1f} | "
              f"{statistics.median(r['decode']) * 1e3:>14.2f} / {min(r['decode']) * 1e3:>14.2f} | "
              f"{max(r['pages']):>10.0f}")
    for name, r in results.items():
        print(f"{name} per prompt: prefill ms {[round(x * 1e3, 1) for x in r['prefill']]}, "
              f"decode ms/token {[round(x * 1e3, 2) for x in r['decode']]}")


if __name__ == "__main__":
    sys.exit(main())
