"""The device-side phases of benchmarks/gpu.py: the engine's checks and the benchmark (GPU only), one engine
per process.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the scheduler and the model
runner can be watched; every engine uses bf16, FlashAttention 3, vLLM's default CUDA graphs (vLLM compiles
the model; attention runs between the captured pieces, where eviction's hooks are), 16-token pages,
dummy weights, async scheduling as vLLM sets it on a GPU (on), and the model runner the caller chose
(``VLLM_USE_V2_MODEL_RUNNER``, set by gpu.py before vLLM is imported). Every check and every figure goes
to ``Records`` (gpu.py) as soon as it is known.
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
from dataclasses import dataclass
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
                  eviction: dict[str, Any] | None = None, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(kv_cache_dtype=kv_cache_dtype,
        model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len, block_size=PAGE,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK, enable_prefix_caching=False, seed=0,
        kv_cache_memory_bytes=kv_bytes, disable_log_stats=True,  # async scheduling: vLLM's choice (on)
        attention_config={"backend": "FLASH_ATTN", "flash_attn_version": 3})  # CUDA graphs: vLLM's default
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
class GraphModes:
    """The CUDA graph mode vLLM picks for every scheduled step, beside whether the step had eviction work
    in some layer (engine/cuda_graphs.py): full graphs must run on steps without, never on steps with."""

    def __init__(self, runner: Any) -> None:
        from vllm_evict.engine.cuda_graphs import HOOK_ATTR

        self.picks: list[tuple[bool, str]] = []
        if hasattr(runner, "cudagraph_manager"):  # Model Runner V2: a BatchExecutionDescriptor
            owner, read = runner.cudagraph_manager, lambda result: result.cg_mode.name
        else:  # V1: (mode, BatchDescriptor)
            owner, read = runner.cudagraph_dispatcher, lambda result: result[0].name
        guarded = owner.dispatch
        assert hasattr(guarded, HOOK_ATTR), "the plugin did not guard vLLM's CUDA graph pick"

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            result = guarded(*args, **kwargs)
            self.picks.append((bool(runner.evict_layer_step), read(result)))
            return result

        owner.dispatch = dispatch

    def summary(self) -> tuple[bool, str]:
        full_free = sum(1 for work, mode in self.picks if not work and mode == "FULL")
        full_work = sum(1 for work, mode in self.picks if work and mode == "FULL")
        free = sum(1 for work, _ in self.picks if not work)
        return (full_free > 0 and full_work == 0,
                f"{len(self.picks)} picks: FULL on {full_free} of {free} without eviction work, on {full_work} with it")


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
        runner_module.return_window_pages = self._checked(runner_module.return_window_pages)
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


class JitMonitorLog:
    """What vLLM's JIT monitor logs (``vllm.utils.jit_monitor``: "... JIT compilation during inference: <kernel>")."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        handler = logging.Handler(level=logging.WARNING)
        handler.emit = lambda record: self.messages.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("vllm.utils.jit_monitor").addHandler(handler)

    def ours(self) -> list[str]:
        return [m for m in self.messages if "during inference" in m and any(k in m for k in OUR_KERNELS)]


# ---- engine checks ---------------------------------------------------------------------------------
class Checks:
    def __init__(self, records: Any) -> None:
        self.records, self.all_ok = records, True

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.all_ok &= bool(ok)
        self.records.add("check", name=name, ok=bool(ok), detail=detail)


ENGINE = dict(kv_bytes=8 * GIB, max_model_len=4096, max_num_seqs=64)
EXACT_PROMPTS, EXACT_TOKENS = 24, 32


def exact_prompts(model: str) -> list[dict[str, list[int]]]:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    return random_prompts(EXACT_PROMPTS, lambda i: 200 + 120 * i, vocab, seed=1)


def token_record(outputs: list[Any]) -> list[dict[str, Any]]:
    """Each request's greedy tokens and their logprobs."""
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outputs]


def compare(name: str, got: list[dict[str, Any]], want: list[dict[str, Any]], checks: Checks) -> None:
    same = [a["tokens"] == b["tokens"] for a, b in zip(got, want)]
    diffs = [abs(x - y) for a, b in zip(got, want) if a["tokens"] == b["tokens"]
             for x, y in zip(a["logprobs"], b["logprobs"])]
    checks.add(name, len(got) == len(want) and all(same),
               f"{sum(same)}/{len(want)} requests equal; max |logprob diff| {max(diffs, default=0):.2e}")


def fp8_refusal(model: str, checks: Checks) -> None:
    """Refused while the config is built: no engine, no GPU memory."""
    try:
        make_llm(**engine_kwargs(model, kv_bytes=GIB, max_model_len=4096, max_num_seqs=8,
                                 eviction={"policy": "criticalkv+snapkv", "budget": 256}), quantization="fp8")
    except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome
        checks.add("criticalkv refused on an fp8 checkpoint", "quantized (fp8)" in str(exc), str(exc)[:200])
        return
    checks.add("criticalkv refused on an fp8 checkpoint", False, "the engine started")


def engine_vanilla(model: str, records: Any, tokens_path: Path) -> int:
    """vLLM without the plugin: the greedy tokens the eviction engines must reproduce (``tokens_path``)."""
    checks, started = Checks(records), time.perf_counter()
    fp8_refusal(model, checks)
    llm = make_llm(**engine_kwargs(model, **ENGINE))
    got = token_record(llm.generate(exact_prompts(model), greedy(EXACT_TOKENS, logprobs=0), use_tqdm=False))
    tokens_path.write_text(json.dumps(got))
    checks.add("vanilla engine serves the exactness batch", all(len(r["tokens"]) == EXACT_TOKENS for r in got),
               f"{len(got)} requests, async scheduling {llm.llm_engine.vllm_config.scheduler_config.async_scheduling}")
    close(llm)
    records.finish(seconds=round(time.perf_counter() - started, 1))
    return 0 if checks.all_ok else 1


def engine_checks(model: str, records: Any, runner: str, reference: Path | None, kv_cache_dtype: str = "auto") -> int:
    """``kv_cache_dtype`` fp8: the same checks over FA3's fp8 KV cache (exactness against eviction off in the
    same engine only: fp8 rounds K and V, vanilla bf16 is not the reference there)."""
    from vllm import SamplingParams

    from vllm_evict.engine.runner_v2 import EvictV2RunnerMixin
    from vllm_evict.engine.scheduler import EvictAsyncScheduler
    from vllm_evict.engine.warmup import warmup_configs

    checks, started = Checks(records), time.perf_counter()
    watch, jit = CompileWatch(), JitMonitorLog()
    # Every method is reserved for requests (the batch below asks for each of them).
    server = {"policy": "snapkv", "budget": 65536, "request_policies": sorted({c.policy for c in warmup_configs()})}
    llm = make_llm(**engine_kwargs(model, **ENGINE, eviction=server, kv_cache_dtype=kv_cache_dtype))
    watch.mark()
    model_runner = runner_of(llm)
    if kv_cache_dtype != "auto":
        layer = model_runner.evict_layers[0]
        checks.add(f"the eviction engine starts over a {kv_cache_dtype} KV cache and reads it as float8 with the "
                   "layers' scales", str(layer.k.dtype).startswith("torch.float8") and layer.k_scale is not None,
                   f"layout {model_runner.evict_layout}, K view {layer.k.dtype}, k_scale "
                   f"{None if layer.k_scale is None else float(layer.k_scale.reshape(-1)[0])}")
    kind = "v2" if isinstance(model_runner, EvictV2RunnerMixin) else "v1"
    checks.add(f"the engine runs the {runner.upper()} model runner", kind == runner, type(model_runner).__name__)
    scheduler = core_of(llm).scheduler
    checks.add("async scheduling on, with the eviction scheduler's async variant",
               llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
               and isinstance(scheduler, EvictAsyncScheduler), type(scheduler).__name__)
    monitor = PathMonitor(model_runner)
    graphs = GraphModes(model_runner)
    checks.add("vLLM's default CUDA graph mode kept (FULL_AND_PIECEWISE)",
               llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name == "FULL_AND_PIECEWISE",
               llm.llm_engine.vllm_config.compilation_config.cudagraph_mode.name)
    prompts = exact_prompts(model)
    off = token_record(llm.generate(prompts, greedy(EXACT_TOKENS, logprobs=0, kv_eviction="none"), use_tqdm=False))
    on = token_record(llm.generate(prompts, greedy(EXACT_TOKENS, logprobs=0), use_tqdm=False))
    compare("budget above every length gives the tokens of eviction off", on, off, checks)
    if reference is not None and reference.exists():
        compare("budget above every length gives vanilla vLLM's tokens", on, json.loads(reference.read_text()), checks)

    specs = warmup_configs()
    extras = {f"evict-{i}": {"kv_eviction": c.policy, "kv_budget": 256,
                             "kv_eviction_config": json.dumps(dict(c.options))} for i, c in enumerate(specs)}
    tracker = PageTracker(core_of(llm), server, extras, max_new=64)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    evicting = random_prompts(len(specs), lambda i: 900 + 53 * i, vocab, seed=2)
    engine = llm.llm_engine
    for i, prompt in enumerate(evicting):
        engine.add_request(f"evict-{i}", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True,
                                                               extra_args=extras[f"evict-{i}"]))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    complete = sum(len(o.outputs[0].token_ids) == 64 for o in finished)
    dtype_name = "bf16" if kv_cache_dtype == "auto" else f"a {kv_cache_dtype} KV cache"
    checks.add(f"every method evicts in {dtype_name} + FA3 + vLLM's CUDA graphs", complete == len(specs) and tracker.evictions > 0,
               f"{complete}/{len(specs)} requests complete, {tracker.evictions} (request, step) evictions")
    checks.add("full CUDA graphs on steps without eviction work, never on steps with it", *graphs.summary())
    checks.add("pages within each request's bound", not tracker.violations,
               f"largest pages/bound {tracker.worst:.2f}" + (f"; {tracker.violations[:3]}" if tracker.violations else ""))
    checks.add("no host-device sync in the hooks, the step builder and the row bookkeeping",
               not monitor.syncs and monitor.calls > 0,
               f"{monitor.calls} audited calls; {len(monitor.syncs)} syncs {sorted(set(monitor.syncs))[:5]}")
    checks.add("no host-to-device copy from pageable memory there", not monitor.pageable,
               f"{len(monitor.pageable)} {sorted(set(monitor.pageable))[:5]}")
    checks.add("no eviction kernel compiled after start-up", watch.available and not watch.after_start,
               f"{len(set(watch.during_start))} kernels compiled at start-up; after: {sorted(set(watch.after_start))}"
               if watch.available else "this Triton has no jit_post_compile_hook")
    checks.add("vLLM's JIT monitor logs no eviction kernel compiled during inference", not jit.ours(),
               f"{len(jit.messages)} JIT monitor warnings, ours: {jit.ours()[:3]}")
    close(llm)
    records.finish(seconds=round(time.perf_counter() - started, 1))
    return 0 if checks.all_ok else 1


# ---- benchmark -------------------------------------------------------------------------------------
@dataclass
class Scenario:
    name: str
    requests: int
    prompt: int
    generate: int


def timed_steps(core: Any) -> tuple[list[dict[str, float]], Callable[[], None]]:
    """Every engine step from now on: wall seconds, tokens, running requests, whether it only decoded, and
    eviction seconds (the worker's step timer, read where the worker reports it); and the ``flush`` to call
    after the run (``engine_watch.watch_steps``)."""
    steps: list[dict[str, float]] = []

    def record(output: Any, seconds: float, eviction: float) -> None:
        steps.append({"s": seconds, "tokens": output.total_num_scheduled_tokens,
                      "decode": output.total_num_scheduled_tokens == len(output.num_scheduled_tokens),
                      "running": len(core.scheduler.running), "eviction_s": eviction})

    return steps, watch_steps(core, record)


def _share(steps: list[dict[str, float]]) -> float | None:
    return sum(s["eviction_s"] for s in steps) / sum(s["s"] for s in steps) if steps else None


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
    return {"variant": name, "seconds": round(seconds, 2), "tokens_per_s": total / seconds,
            "generated_per_s": generated / seconds, "max_running": max((s["running"] for s in steps), default=0),
            "step_ms_mean": 1000 * statistics.mean(s["s"] for s in steps) if steps else 0.0,
            "eviction_share": _share(steps),
            # eviction's share of the steps of (mostly) prompt chunks, and of the steps that only decode
            "prefill_chunk_eviction_share": _share([s for s in steps if s["tokens"] >= chunk // 2]),
            "decode_hook_share": _share([s for s in steps if s["decode"]]),
            "preemptions": preempted(), "steps": len(steps),
            "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling}


def scenarios(requests_8k: int, quick: bool) -> dict[str, Scenario]:
    return {"8k": Scenario(f"equal KV memory ({requests_8k} x 8000 + 128)", min(requests_8k, 8) if quick else requests_8k,
                           8000, 32 if quick else 128),
            "spare": Scenario("memory to spare (64 x 2048 + 256)", 16 if quick else 64, 2048, 64 if quick else 256)}


MAX_MODEL_LEN = 8192  # the longest vLLM derives for the 8B config (its llama3 RoPE scaling's original length)


def variants(scenario: str, side: str, full: bool) -> list[tuple[str, dict[str, Any] | None]]:
    """(name, the requests' extra_args) of one side of a scenario, measured in this order."""
    if side == "vanilla":
        return [("vanilla", None)]
    if scenario == "8k":
        return [("keydiff 1024 (chunked)", None)] + (
            [("snapkv 1024 (chunked)", {"kv_eviction": "snapkv", "kv_eviction_config": '{"schedule": "chunked"}'})]
            if full else [])
    # Never evicting: a budget of max_model_len (a request may not ask for more), above every request here.
    return [("eviction on, never evicting", {"kv_budget": MAX_MODEL_LEN}), ("keydiff 1024", None)] + (
        [("snapkv 1024", {"kv_eviction": "snapkv"})] if full else [])


def bench(model: str, records: Any, *, runner: str, scenario: str, side: str, kv_gib: float, requests_8k: int,
          quick: bool = False, full: bool = False) -> int:
    """One engine (vanilla or eviction) measuring one scenario's variants, each recorded as it is measured."""
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    case = scenarios(requests_8k, quick)[scenario]
    common = dict(kv_bytes=int(kv_gib * GIB), max_model_len=MAX_MODEL_LEN, max_num_seqs=128)
    notes = [f"KV memory of each engine: {kv_gib} GiB (eviction's buffers come out of it); chunk {CHUNK} tokens; "
             f"pages of {PAGE}; Llama-3.1-8B geometry, dummy weights, bf16, FA3, vLLM's default CUDA graphs, async "
             "scheduling; one engine per process."]
    started = time.perf_counter()
    eviction = None
    if side == "eviction":
        eviction = {"policy": "keydiff", "budget": 1024, **({"request_policies": ["snapkv"]} if full else {})}
    llm = make_llm(**engine_kwargs(model, **common, eviction=eviction))
    for name, extra in variants(scenario, side, full):
        result = measure(llm, case, vocab, name, extra)
        records.add("measure", runner=runner, scenario=case.name, **result)
    close(llm)
    records.finish(notes=notes, seconds=round(time.perf_counter() - started, 1))
    return 0


# ---- fp8 capacity (issue #29) ---------------------------------------------------------------------------
CAPACITY = dict(kv_gib=0.5, requests=384, prompt=2000, generate=64, max_num_seqs=512, budget=256)


def capacity(model: str, records: Any, *, eviction: bool) -> int:
    """Requests held at once and throughput at equal KV memory (``CAPACITY``) for fp8 then bf16, vanilla or
    eviction (KeyDiff at budget 256), on the small model's geometry: one engine at a time in this process
    (closed before the next; each asks for half the GPU so that what the previous one left cannot stop it)."""
    c = CAPACITY
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    config = {"policy": "keydiff", "budget": c["budget"]} if eviction else None
    ok = True
    for kv_cache_dtype in ("fp8", "auto"):
        name = f"{'eviction (keydiff 256)' if eviction else 'vanilla'} {'bf16' if kv_cache_dtype == 'auto' else 'fp8'}"
        try:
            llm = make_llm(**engine_kwargs(model, kv_bytes=int(c["kv_gib"] * GIB), max_model_len=4096,
                                           max_num_seqs=c["max_num_seqs"], eviction=config,
                                           kv_cache_dtype=kv_cache_dtype), gpu_memory_utilization=0.5)
        except Exception as exc:  # noqa: BLE001 - recorded; the other dtype is still measured
            records.add("error", variant=name, error=f"{type(exc).__name__}: {exc}"[:400])
            ok = False
            continue
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        scenario = Scenario(f"{c['requests']} x {c['prompt']} + {c['generate']}", c["requests"], c["prompt"],
                            c["generate"])
        result = measure(llm, scenario, vocab, name, None)
        records.add("measure", scenario="fp8 capacity", kv_cache_dtype=kv_cache_dtype, eviction=eviction,
                    kv_gib=c["kv_gib"], pages=blocks, **result)
        close(llm)
    records.finish(seconds=round(time.perf_counter() - started, 1),
                   notes=[f"{c['kv_gib']} GiB of KV memory for every variant (eviction's buffers come out of it); "
                          f"{c['requests']} prompts of {c['prompt']} tokens + {c['generate']} generated, "
                          f"max_num_seqs {c['max_num_seqs']}; SmolLM2-135M geometry, dummy weights, FA3, vLLM's "
                          "default CUDA graphs, async scheduling"])
    return 0 if ok else 1
