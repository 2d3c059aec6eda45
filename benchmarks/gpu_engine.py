"""The device-side phases of benchmarks/gpu.py: the engine's checks and the benchmark (GPU only).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the scheduler and the model
runner can be watched; every engine uses bf16, FlashAttention 3, piecewise CUDA graphs (vLLM compiles
the model; attention runs between the captured pieces, where eviction's hooks are), 16-token pages,
dummy weights, and vLLM's V1 model runner (the one eviction hooks).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import random
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import torch  # noqa: E402

from engine_watch import count_preemptions, watch_steps  # noqa: E402  (benchmarks/ is on sys.path: gpu.py)

PAGE = 16
CHUNK = 2048  # max_num_batched_tokens: the prefill chunk
GIB = 1 << 30
OUR_KERNELS = ("_window_lse_kernel", "_window_colsum_kernel", "_keydiff_sum_kernel", "_keydiff_score_kernel",
               "_center_sum_kernel", "_output_error_kernel", "_value_norms_kernel", "_compact_kernel")


def engine_kwargs(model: str, *, kv_bytes: int, max_model_len: int, max_num_seqs: int,
                  eviction: dict[str, Any] | None = None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, block_size=PAGE,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK, enable_prefix_caching=False, seed=0,
        kv_cache_memory_bytes=kv_bytes, async_scheduling=False, disable_log_stats=True,
        attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3},
        compilation_config={"cudagraph_mode": "PIECEWISE"})
    if eviction is not None:
        kwargs["additional_config"] = {"kv_eviction": eviction}
    return kwargs


def make_llm(**kwargs: Any) -> Any:
    from vllm import LLM

    return LLM(**kwargs)


def close(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the next engine needs the memory
        pass
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def core_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def runner_of(llm: Any) -> Any:
    return core_of(llm).model_executor.driver_worker.worker.model_runner


def random_prompts(count: int, lengths: Callable[[int], int], vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(lengths(i))]} for i in range(count)]


def greedy(max_tokens: int, logprobs: int | None = None, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                          extra_args=extra or None)


# ---- watching the eviction path --------------------------------------------------------------------
class PathMonitor:
    """Around the eviction hooks (vLLM's attention forward inside them excluded), the step builder,
    elastic compressions and the per-row bookkeeping: every synchronising CUDA call (``torch.cuda.set_sync_debug_mode("warn")``,
    the warnings recorded with their Python location) and every host-to-device copy from unpinned
    memory (``Tensor.copy_`` / ``Tensor.to`` inspected while active)."""

    def __init__(self, runner: Any) -> None:
        from vllm_evict.engine import runner as runner_module
        from vllm_evict.engine.runner import HOOK_ATTR

        self.syncs: list[str] = []
        self.pageable: list[str] = []
        self.calls = 0
        self._active = False
        for index, (_, module) in enumerate(runner._attention_layers()):
            original = getattr(module.impl.forward, HOOK_ATTR)
            module.impl.forward = self._checked(runner._make_hook(index, self._unchecked(original)))
        runner.evict_builder.build = self._checked(runner.evict_builder.build)
        runner_module.compress_before_forward = self._checked(runner_module.compress_before_forward)
        rows = runner.evict_rows  # per-row bookkeeping as requests join and leave the batch
        for name in ("add", "park", "forget", "clear", "move", "swap"):
            setattr(rows, name, self._checked(getattr(rows, name)))
        rows.on_new_policy = self._unchecked(rows.on_new_policy)  # a method's first request: once
        self._install_copy_checks()

    def _install_copy_checks(self) -> None:
        monitor, copy_, to = self, torch.Tensor.copy_, torch.Tensor.to

        def checked_copy(dst: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> Any:
            if monitor._active and isinstance(src, torch.Tensor) and dst.is_cuda and not src.is_cuda \
                    and not src.is_pinned():
                monitor.pageable.append(f"copy_ from pageable {tuple(src.shape)} {src.dtype}")
            return copy_(dst, src, *args, **kwargs)

        def checked_to(src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = to(src, *args, **kwargs)
            if monitor._active and not src.is_cuda and out.is_cuda and not src.is_pinned():
                monitor.pageable.append(f"to(cuda) from pageable {tuple(src.shape)} {src.dtype}")
            return out

        torch.Tensor.copy_, torch.Tensor.to = checked_copy, checked_to

    def _checked(self, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self._active:  # inside a checked call already
                return fn(*args, **kwargs)
            self._active = True
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self._active = False
                self.syncs += [f"{w.filename}:{w.lineno}: {str(w.message)[:120]}" for w in caught
                               if "synchronizing" in str(w.message)]
        return run

    def _unchecked(self, fn: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            active, self._active = self._active, False
            torch.cuda.set_sync_debug_mode(0)
            try:
                return fn(*args, **kwargs)
            finally:
                self._active = active
                if active:
                    torch.cuda.set_sync_debug_mode("warn")
        return run


class CompileWatch:
    """Triton compiles of vllm_evict's kernels (``knobs.runtime.jit_post_compile_hook``), with the time
    they happened relative to ``mark()`` (start-up done)."""

    def __init__(self) -> None:
        self.after_start: list[str] = []
        self.during_start: list[str] = []
        self._started = False
        try:
            from triton import knobs

            previous = knobs.runtime.jit_post_compile_hook
        except (ImportError, AttributeError):  # a Triton without the hook: reported as unavailable
            self.available = False
            return
        self.available = True

        def hook(**kwargs: Any) -> Any:
            name = getattr(kwargs.get("fn"), "name", "") or str(kwargs.get("fn"))
            if any(k in name for k in OUR_KERNELS):
                (self.after_start if self._started else self.during_start).append(name)
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook

    def mark(self) -> None:
        self._started = True


class PageTracker:
    """After every schedule: each running request's pages against ``schedule.request_bound``."""

    def __init__(self, core: Any, server: dict[str, Any], extras: dict[str, dict], max_new: int) -> None:
        from vllm_evict.request_settings import resolve_request_config
        from vllm_evict.schedule import request_bound

        scheduler = core.scheduler
        page, chunk = scheduler.page_size, scheduler.scheduler_config.max_num_batched_tokens
        self.worst = 0.0  # the largest pages / bound seen
        self.violations: list[str] = []
        self.evictions = 0
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            plan = getattr(output, "kv_eviction_plan", None)
            self.evictions += len(plan.keep) if plan is not None else 0
            for request in scheduler.running:
                rid = request.request_id
                extra = extras.get(rid.rsplit("-", 1)[0])
                if extra is None:
                    continue
                config = resolve_request_config(server, extra)
                bound = request_bound(config, prompt_len=request.num_prompt_tokens, max_new_tokens=max_new,
                                      page_size=page, chunk=chunk, replayed=request.num_output_tokens)
                pages = len(scheduler.attention_manager.req_to_blocks.get(rid, ()))
                allowed = math.ceil(bound / page)
                self.worst = max(self.worst, pages / allowed)
                if pages > allowed:
                    self.violations.append(f"{rid}: {pages} pages > {allowed} ({bound} tokens)")
            return output

        scheduler.schedule = schedule


# ---- engine checks ---------------------------------------------------------------------------------
@dataclass
class Checks:
    checks: list[dict[str, Any]] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"[engine] {'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def fp8_refusal(model: str, checks: Checks) -> None:
    try:
        make_llm(**engine_kwargs(model, kv_bytes=GIB, max_model_len=4096, max_num_seqs=8,
                                 eviction={"policy": "criticalkv+snapkv", "budget": 256}), quantization="fp8")
    except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome
        checks.add("criticalkv refused on an fp8 checkpoint", "quantized (fp8)" in str(exc), str(exc)[:200])
        return
    checks.add("criticalkv refused on an fp8 checkpoint", False, "the engine started")


def engine_checks(model: str, out: Path) -> int:
    from vllm_evict.engine.warmup import warmup_configs

    checks = Checks()
    started = time.perf_counter()
    fp8_refusal(model, checks)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(24, lambda i: 200 + 120 * i, vocab, seed=1)
    common = dict(kv_bytes=8 * GIB, max_model_len=4096, max_num_seqs=64)

    llm = make_llm(**engine_kwargs(model, **common))
    vanilla = llm.generate(prompts, greedy(32, logprobs=0), use_tqdm=False)
    close(llm)

    watch = CompileWatch()
    # Every method is reserved for requests (the batch below asks for each of them).
    server = {"policy": "snapkv", "budget": 65536,
              "request_policies": sorted({c.policy for c in warmup_configs()})}
    llm = make_llm(**engine_kwargs(model, **common, eviction=server))
    watch.mark()
    runner = runner_of(llm)
    monitor = PathMonitor(runner)
    got = llm.generate(prompts, greedy(32, logprobs=0), use_tqdm=False)
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(vanilla, got)]
    diffs = [abs(sa[ta].logprob - sb[tb].logprob) for a, b in zip(vanilla, got)
             for sa, sb, ta, tb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids,
                                       b.outputs[0].token_ids) if ta == tb]
    checks.add("budget above every length gives vanilla's tokens", all(same),
               f"{sum(same)}/{len(same)} requests equal; max |logprob diff| {max(diffs, default=0):.2e}")

    specs = warmup_configs()
    extras = {f"evict-{i}": {"kv_eviction": c.policy, "kv_budget": 256,
                       "kv_eviction_config": json.dumps(dict(c.options))} for i, c in enumerate(specs)}
    tracker = PageTracker(core_of(llm), server, extras, max_new=64)
    evicting = random_prompts(len(specs), lambda i: 900 + 53 * i, vocab, seed=2)
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, extra_args=extras[f"evict-{i}"])
              for i in range(len(specs))]
    engine = llm.llm_engine
    for i, (prompt, p) in enumerate(zip(evicting, params)):
        engine.add_request(f"evict-{i}", prompt, p)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    complete = sum(len(o.outputs[0].token_ids) == 64 for o in finished)
    checks.add("every method evicts in bf16 + FA3 + piecewise graphs", complete == len(specs) and tracker.evictions > 0,
               f"{complete}/{len(specs)} requests complete, {tracker.evictions} (request, step) evictions")
    checks.add("pages within each request's bound", not tracker.violations,
               f"largest pages/bound {tracker.worst:.2f}"
               + (f"; {tracker.violations[:3]}" if tracker.violations else ""))
    checks.add("no host-device sync in the hooks and the step builder", not monitor.syncs and monitor.calls > 0,
               f"{monitor.calls} audited calls; {len(monitor.syncs)} syncs {sorted(set(monitor.syncs))[:5]}")
    checks.add("no host-to-device copy from pageable memory there", not monitor.pageable,
               f"{len(monitor.pageable)} {sorted(set(monitor.pageable))[:5]}")
    checks.add("no eviction kernel compiled after start-up", watch.available and not watch.after_start,
               f"{len(set(watch.during_start))} kernels compiled at start-up; after: {sorted(set(watch.after_start))}"
               if watch.available else "this Triton has no jit_post_compile_hook")
    close(llm)
    result = {"checks": checks.checks, "seconds": round(time.perf_counter() - started, 1)}
    out.write_text(json.dumps(result, indent=1))
    return 0 if all(c["ok"] for c in checks.checks) else 1


# ---- benchmark -------------------------------------------------------------------------------------
@dataclass
class Scenario:
    name: str
    requests: int
    prompt: int
    generate: int


def timed_steps(core: Any) -> tuple[list[dict[str, float]], Callable[[], None]]:
    """Every engine step from now on: wall seconds, tokens, running requests, eviction seconds (the
    worker's step timer, read where the worker reports it)."""
    steps: list[dict[str, float]] = []

    def record(output: Any, seconds: float, eviction: float) -> None:
        steps.append({"s": seconds, "tokens": output.total_num_scheduled_tokens,
                      "running": len(core.scheduler.running), "eviction_s": eviction})

    return steps, watch_steps(core, record)


def measure(llm: Any, scenario: Scenario, vocab: int, name: str, extra: dict[str, Any] | None) -> dict[str, Any]:
    core = core_of(llm)
    prompts = random_prompts(scenario.requests, lambda i: scenario.prompt, vocab, seed=7)
    llm.generate(random_prompts(1, lambda i: 64, vocab, seed=8), greedy(4, **(extra or {})), use_tqdm=False)
    steps, flush = timed_steps(core)
    preempted = count_preemptions(core.scheduler)
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy(scenario.generate, **(extra or {})), use_tqdm=False)
    seconds = time.perf_counter() - start
    flush()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    total = generated + scenario.requests * scenario.prompt
    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prefill = [s for s in steps if s["tokens"] >= chunk // 2]  # steps of (mostly) prompt chunks
    evict_s = sum(s["eviction_s"] for s in steps)
    result = {"name": name, "seconds": round(seconds, 2), "tokens_per_s": total / seconds,
              "generated_per_s": generated / seconds, "max_running": max((s["running"] for s in steps), default=0),
              "step_ms_mean": 1000 * statistics.mean(s["s"] for s in steps) if steps else 0.0,
              "eviction_share": evict_s / max(sum(s["s"] for s in steps), 1e-9),
              "prefill_chunk_eviction_share": (sum(s["eviction_s"] for s in prefill) / sum(s["s"] for s in prefill)
                                               if prefill else None),
              "preemptions": preempted(), "steps": len(steps)}
    print(f"[bench] {scenario.name} {name}: {json.dumps({k: v for k, v in result.items() if k != 'name'})}", flush=True)
    return result


def bench(model: str, out: Path, *, kv_gib: float, requests_8k: int, quick: bool = False, full: bool = False) -> int:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    spare = Scenario("memory to spare (64 x 2048 + 256)", 16 if quick else 64, 2048, 64 if quick else 256)
    tight = Scenario(f"equal KV memory ({requests_8k} x 8000 + 128)", min(requests_8k, 8) if quick else requests_8k,
                     8000, 32 if quick else 128)
    # 8192: the longest vLLM derives for this config (its llama3 RoPE scaling's original length)
    common = dict(kv_bytes=int(kv_gib * GIB), max_model_len=8192, max_num_seqs=128)
    notes = [f"KV memory of each engine: {kv_gib} GiB (eviction's buffers come out of it); chunk {CHUNK} tokens; "
             f"pages of {PAGE}; Llama-3.1-8B geometry, dummy weights, bf16, FA3, piecewise CUDA graphs."]
    results = {"spare": [], "tight": []}
    started = time.perf_counter()

    llm = make_llm(**engine_kwargs(model, **common))
    results["spare"].append(measure(llm, spare, vocab, "vanilla", None))
    results["tight"].append(measure(llm, tight, vocab, "vanilla", None))
    close(llm)

    llm = make_llm(**engine_kwargs(model, **common, eviction={"policy": "keydiff", "budget": 1024}))
    results["spare"].append(measure(llm, spare, vocab, "eviction on, never evicting", {"kv_budget": 100000}))
    results["spare"].append(measure(llm, spare, vocab, "keydiff 1024", None))
    if full:
        results["spare"].append(measure(llm, spare, vocab, "snapkv 1024", {"kv_eviction": "snapkv"}))
    results["tight"].append(measure(llm, tight, vocab, "keydiff 1024 (chunked)", None))
    if full:
        results["tight"].append(measure(llm, tight, vocab, "snapkv 1024 (chunked)",
                                        {"kv_eviction": "snapkv", "kv_eviction_config": '{"schedule": "chunked"}'}))
    close(llm)
    if full:  # SnapKV's window kept as queries in a ring reserved at start-up (docs/engine.md#observation-windows)
        llm = make_llm(**engine_kwargs(model, **common,
                                       eviction={"policy": "snapkv", "budget": 1024, "window_ring": True}))
        results["spare"].append(measure(llm, spare, vocab, "snapkv 1024, window ring", None))
        close(llm)
    data = {"scenarios": [{"name": spare.name, "variants": results["spare"]},
                          {"name": tight.name, "variants": results["tight"]}],
            "notes": notes, "seconds": round(time.perf_counter() - started, 1)}
    out.write_text(json.dumps(data, indent=1))
    return 0
