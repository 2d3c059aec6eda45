"""Prefill and decode time with and without KV eviction, in the real vLLM engine on CPU, in one run.

    python benchmarks/engine.py                      # SmolLM2-135M-Instruct (vllm_evict.models)
    python benchmarks/engine.py --tiny               # tiny random Llama: a quick smoke run
    python benchmarks/engine.py --model PATH --policy caote+snapkv --budget 128 --prompt-len 1024

Both engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with the same settings except
``additional_config={"kv_eviction": ...}``, and take turns on the same prompts (random token ids, one
request at a time, prefix caching off in both), so a slow spell of a shared machine hits both. Per prompt:

- prefill = wall time of a request with max_tokens=1 (time to first token);
- decode  = (wall time of the same prompt with max_tokens=N - prefill) / (N - 1), per token;
- pages   = the most KV pages the scheduler held for the request at any step (read right after each
  ``schedule()``, when a step's pages are allocated and before eviction gives any back).

Times are the median and the minimum over --repeats prompts, after one warm-up request per engine; on a
shared machine the minimum is the steadier figure (a busy neighbour only ever adds time).
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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_evict.testing import use_offline_cpu_env  # noqa: E402

use_offline_cpu_env()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct, prepared "
                                                      "by vllm_evict.models)")
    source.add_argument("--tiny", action="store_true", help="a tiny random Llama (2 layers, 2 KV heads, head_dim 32) "
                                                            "for a quick run")
    parser.add_argument("--policy", default="snapkv", help="eviction policy [META+]BASE (default: snapkv)")
    parser.add_argument("--budget", type=int, default=64, help="tokens kept per sequence, layer and KV head (64)")
    parser.add_argument("--eviction-config", type=json.loads, default=None, metavar="JSON",
                        help='more eviction options, e.g. \'{"schedule": "oneshot", "window": 16}\'')
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (256)")
    parser.add_argument("--gen-len", type=int, default=32, help="generated tokens N for the decode timing (32)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts timed per engine (3)")
    parser.add_argument("--dtype", default="float32", help="model dtype (float32)")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV page (32)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="prefill chunk size (default: the prompt length, one chunk)")
    parser.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache pool size in MiB (256)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.gen_len < 2:
        parser.error("--gen-len must be at least 2 (decode time is taken over N - 1 tokens)")
    return args


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.tiny:
        from vllm_evict.testing import build_tiny_llama

        return str(build_tiny_llama(Path(tempfile.gettempdir()) / "vllm-evict-bench-tiny-llama"))
    from vllm_evict import models

    return str(models.prepare())


class PageTracker:
    """Records, per request, the most pages the scheduler held right after any ``schedule()``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.peak: dict[str, int] = {}
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            for request_id in output.num_scheduled_tokens:
                held = len(manager.req_to_blocks.get(request_id, ()))
                self.peak[request_id] = max(self.peak.get(request_id, 0), held)
            return output

        scheduler.schedule = schedule  # the engine core calls self.scheduler.schedule()

    def take(self) -> int:
        """Peak pages over the requests since the last call."""
        peak = max(self.peak.values(), default=0)
        self.peak.clear()
        return peak


def make_prompts(args: argparse.Namespace, vocab: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(args.seed)
    low, high = min(10, vocab // 4), vocab - 10  # away from special tokens at either end
    return [{"prompt_token_ids": [rng.randrange(low, high) for _ in range(args.prompt_len)]}
            for _ in range(args.repeats + 1)]  # the first one warms up


class Engine:
    """One in-process LLM, its page tracker and a timed generate."""

    def __init__(self, args: argparse.Namespace, model: str, eviction: dict[str, Any] | None) -> None:
        from vllm import LLM

        chunk = args.max_num_batched_tokens or max(args.prompt_len, args.block_size)
        kwargs: dict[str, Any] = dict(
            model=model, dtype=args.dtype, enforce_eager=True, max_model_len=args.prompt_len + args.gen_len + 8,
            max_num_seqs=1, max_num_batched_tokens=chunk, block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_mb << 20, enable_prefix_caching=False, seed=args.seed)
        if eviction is not None:
            kwargs["additional_config"] = {"kv_eviction": eviction}
        self.llm = LLM(**kwargs)
        self.core = self.llm.llm_engine.engine_core.engine_core
        self.tracker = PageTracker(self.core.scheduler)
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.pages_prefill = self.pages = 0

    def timed(self, prompt: dict[str, list[int]], max_tokens: int) -> tuple[float, int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([prompt], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert len(outputs[0].outputs[0].token_ids) == max_tokens, "the engine stopped early"
        return elapsed, self.tracker.take()

    def measure(self, prompt: dict[str, list[int]], gen_len: int) -> None:
        first, pages_1 = self.timed(prompt, 1)
        full, pages_n = self.timed(prompt, gen_len)
        self.prefill.append(first)
        self.decode.append((full - first) / (gen_len - 1))
        self.pages_prefill = max(self.pages_prefill, pages_1)
        self.pages = max(self.pages, pages_n)

    def summary(self) -> dict[str, Any]:
        return dict(prefill=self.prefill, decode=self.decode, pages_prefill=self.pages_prefill, pages=self.pages,
                    scheduler=type(self.core.scheduler).__name__,
                    pool_pages=self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def run(args: argparse.Namespace, model: str, eviction: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both engines stay up and take turns on each prompt, so a slow spell of the machine hits both."""
    engines = [Engine(args, model, None), Engine(args, model, eviction)]
    try:
        prompts = make_prompts(args, engines[0].vocab)
        for engine in engines:
            engine.timed(prompts[0], args.gen_len)  # warm-up: first-call allocations, lazy imports
        for prompt in prompts[1:]:
            for engine in engines:
                engine.measure(prompt, args.gen_len)
        return engines[0].summary(), engines[1].summary()
    finally:
        for engine in engines:
            engine.close()


def describe(args: argparse.Namespace, model: str, eviction: dict[str, Any], schedule: str) -> str:
    import torch
    import vllm

    name = "tiny random Llama" if args.tiny else Path(model).name
    return (f"model {name}, dtype {args.dtype}, prompt {args.prompt_len} tokens, generate {args.gen_len}, "
            f"{args.repeats} prompts, page {args.block_size} tokens\n"
            f"eviction {json.dumps(eviction)} (schedule {schedule}), prefill chunk "
            f"{args.max_num_batched_tokens or max(args.prompt_len, args.block_size)} tokens\n"
            f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")


def report(base: dict[str, Any], evict: dict[str, Any]) -> str:
    def ms(values: list[float], stat: Any) -> str:
        return f"{stat(values) * 1e3:9.1f} ms"

    def ratio(a: list[float], b: list[float], stat: Any) -> str:
        return f"{stat(a) / stat(b):8.2f}x"

    rows = [("", "no eviction", "eviction", "evict/base")]
    for label, key in (("prefill (TTFT)", "prefill"), ("decode per token", "decode")):
        for stat_name, stat in (("median", statistics.median), ("min", min)):
            rows.append((f"{label}, {stat_name}", ms(base[key], stat), ms(evict[key], stat),
                         ratio(evict[key], base[key], stat)))
    rows += [
        ("peak pages / request, prefill", f"{base['pages_prefill']:12d}", f"{evict['pages_prefill']:12d}", ""),
        ("peak pages / request, all", f"{base['pages']:12d}", f"{evict['pages']:12d}", ""),
        ("scheduler", base["scheduler"], evict["scheduler"], ""),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0]:<{width}}  {r[1]:>16}  {r[2]:>16}  {r[3]:>10}" for r in rows]
    lines.append(f"KV pool: {base['pool_pages']} pages. Per prompt, prefill s: base "
                 f"{[round(x, 3) for x in base['prefill']]}, evict {[round(x, 3) for x in evict['prefill']]}; "
                 f"decode ms/token: base {[round(x * 1e3, 1) for x in base['decode']]}, "
                 f"evict {[round(x * 1e3, 1) for x in evict['decode']]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = model_path(args)
    eviction = dict(args.eviction_config or {})
    eviction.update(policy=args.policy, budget=args.budget)
    from vllm_evict.config import EvictionConfig

    config = EvictionConfig.from_mapping(eviction)  # fail on bad settings before loading anything
    base, evict = run(args, model, eviction)
    print(describe(args, model, eviction, config.schedule))
    print(report(base, evict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
