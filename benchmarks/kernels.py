"""The eviction kernels and the engine's eviction step on a GPU, written to docs/benchmarks/kernels.md.

    .venv/bin/python benchmarks/kernels.py                       # measure on the visible CUDA GPU, write the report
    .venv/bin/python benchmarks/kernels.py --dry-run             # the skeleton: nothing measured, bytes computed
    .venv/bin/python benchmarks/kernels.py --device cpu --small  # smoke run of the same code on tiny shapes, on CPU
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/kernels.py --device cpu --small   # ... Triton interpreted too

Shapes: Llama-3.1-8B (32 layers, 8 KV heads, 32 query heads, head size 128, hidden 4096, bf16, pages of 16
tokens), 64 requests, contexts 4k and 32k, SnapKV's 32-query window, 2k-token prefill chunks.

1. Kernels: every ``vllm_evict.ops`` operation on every backend (CUDA where a kernel exists, Triton, and the
   PyTorch reference for scale), batched over the requests: time, the bytes the kernel moves and the
   achieved fraction of the device-to-device copy bandwidth measured in the same run.
2. The engine step, through ``vllm_evict.evict_step`` exactly as engine/step_builder.py and engine/runner.py
   call it: a ``StepPlan`` (``Record`` + ``build_group`` groups), ``record_step``, ``record_layer`` per
   layer and ``evict_layer`` over real ``LayerCache``s on a synthetic paged cache (vLLM's FLASH_ATTN
   layout, shuffled pages) and the engine's own ``EvictionBuffers``; for snapkv, keydiff, caote+snapkv,
   criticalkv+snapkv and h2o (whose state update runs every step):
   (a) a decode step where no request evicts, (b) a 2k-token prefill chunk per request, every request
   evicting back to its budget, (c) a decode step where 4 of the 64 requests evict a page of growth;
   each next to the attention of the same step (torch SDPA), the stand-in for vanilla vLLM's step.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vllm_evict import ops  # noqa: E402
from vllm_evict.config import EvictionConfig  # noqa: E402
from vllm_evict.engine.buffers import EvictionBuffers, Geometry, Layout  # noqa: E402
from vllm_evict.evict_step import (  # noqa: E402
    LayerCache, Record, StepPlan, WindowStep, build_group, evict_layer, record_layer, record_step,
    state_initializers, tokens_view,
)
from vllm_evict.policies.base import Phase, Policy  # noqa: E402
from vllm_evict.schedule import window_end  # noqa: E402

UNMEASURED = "unmeasured"
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "kernels.md"
GPU_COMMAND = ".venv/bin/python benchmarks/kernels.py"
DRY_RUN_COMMAND = f"{GPU_COMMAND} --dry-run"
SMOKE_COMMAND = f"TRITON_INTERPRET=1 {GPU_COMMAND} --device cpu --small"
POLICIES = ("snapkv", "keydiff", "caote+snapkv", "criticalkv+snapkv", "h2o")
RECORD_TARGET, CHUNK_TARGET, BANDWIDTH_TARGET = 0.01, 0.05, 0.70


@dataclass(frozen=True)
class Shapes:
    layers: int
    kv_heads: int
    query_heads: int
    head_size: int
    hidden: int
    page_size: int
    dtype: torch.dtype
    rows: int  # requests in the batch
    contexts: tuple[int, ...]  # tokens cached per request once the step's tokens are in
    window: int  # observation-window queries of the kernel cases (SnapKV's default)
    chunk: int  # prefill chunk per request
    evicting_rows: int  # rows that evict in scenario (c)
    torch_rows: int  # rows the PyTorch reference is timed at (it gathers K/V densely)
    name: str = ""

    @property
    def group(self) -> int:
        return self.query_heads // self.kv_heads

    @property
    def element(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


LLAMA_8B = Shapes(layers=32, kv_heads=8, query_heads=32, head_size=128, hidden=4096, page_size=16,
                  dtype=torch.bfloat16, rows=64, contexts=(4096, 32768), window=32, chunk=2048, evicting_rows=4,
                  torch_rows=8, name="Llama-3.1-8B")
SMALL = Shapes(layers=2, kv_heads=2, query_heads=4, head_size=16, hidden=64, page_size=16, dtype=torch.float32,
               rows=2, contexts=(96, 160), window=16, chunk=32, evicting_rows=1, torch_rows=1, name="tiny")


# ---- what is measured: kernel cases and step scenarios ---------------------------------------------
@dataclass(frozen=True)
class KernelCase:
    """One ``ops`` call: ``context`` candidates per row (0: not per context), ``tokens`` new tokens."""

    op: str
    variant: str
    context: int
    tokens: int = 0

    def backends(self) -> tuple[str, ...]:
        cuda = self.op in ops.CUDA_OPS and self.variant != "per query head"
        return ("cuda", "triton", "torch") if cuda else ("triton", "torch")


def kernel_cases(shapes: Shapes) -> list[KernelCase]:
    cases = []
    for c in shapes.contexts:
        cases += [KernelCase("window_mass", "group sum", c), KernelCase("window_mass", "per query head", c),
                  KernelCase("window_mass", "added into the paged state", c),
                  KernelCase("keydiff_scores", "", c), KernelCase("output_error", "caote", c),
                  KernelCase("compact_tokens", "K, V, positions; half kept", c)]
    cases += [KernelCase("value_norms", "decode step", 0, shapes.rows),
              KernelCase("value_norms", "one prefill chunk", 0, shapes.chunk)]
    return cases


def kernel_bytes(case: KernelCase, s: Shapes, rows: int) -> int:
    """DRAM traffic of the kernel as designed, read + written: each pass of a two-pass kernel reads its
    keys (values) once; ``compact_tokens`` keeps the last half of every row, so every kept slot moves."""
    n, h, e = case.context, s.kv_heads, s.element
    cache = rows * n * h * s.head_size * e  # one of K or V over the rows' candidates
    per_slot_fp32 = rows * n * h * 4
    if case.op == "window_mass":
        out = per_slot_fp32 * (s.group if case.variant == "per query head" else 2 if case.variant.startswith("added")
                               else 1)  # added: the state is read and written
        return 2 * (cache + per_slot_fp32) + rows * s.window * s.query_heads * s.head_size * e + out
    if case.op == "keydiff_scores":
        return 2 * cache + per_slot_fp32
    if case.op == "output_error":  # values and alpha in both passes, scores out
        return 2 * (cache + per_slot_fp32) + per_slot_fp32
    if case.op == "compact_tokens":
        moved = rows * h * (n // 2)
        return 2 * moved * (2 * s.head_size * e + 4) + moved * 8
    if case.op == "value_norms":
        t = case.tokens
        return t * h * s.head_size * e + s.hidden * s.query_heads * s.head_size * e + t * h * 4
    raise KeyError(case.op)


def kernel_flops(case: KernelCase, s: Shapes) -> int:
    """value_norms: one [T, d] x [d, hidden] product per query head."""
    return 2 * case.tokens * s.query_heads * s.head_size * s.hidden if case.op == "value_norms" else 0


@dataclass(frozen=True)
class Scenario:
    """One step of the batch: per row, logical tokens before it (nothing evicted earlier, so also the
    physical ones), tokens it adds, and tokens kept per head after it (-1: the row does not evict)."""

    key: str  # "decode" (a), "chunk" (b), "decode_evict" (c)
    context: int
    computed: np.ndarray
    scheduled: np.ndarray
    keep: np.ndarray
    phase: Phase

    @property
    def num_tokens(self) -> int:
        return int(self.scheduled.sum())

    @property
    def evicting(self) -> int:
        return int((self.keep >= 0).sum())


def scenarios(s: Shapes, context: int, budget: int | None) -> list[Scenario]:
    rows = s.rows
    full = lambda value: np.full(rows, value, dtype=np.int64)  # noqa: E731
    chunk_keep = budget if budget is not None else context - s.chunk
    evict = np.where(np.arange(rows) < s.evicting_rows, context - s.page_size, -1).astype(np.int64)
    return [Scenario("decode", context, full(context - 1), full(1), full(-1), Phase.DECODE),
            Scenario("chunk", context, full(context - s.chunk), full(s.chunk), full(chunk_keep), Phase.PROMPT_END),
            Scenario("decode_evict", context, full(context - 1), full(1), evict, Phase.DECODE)]


SCENARIO_TITLES = {
    "decode": "(a) Decode step, no request evicts: the record phase next to the step's attention",
    "chunk": "(b) One prefill chunk per request, every request evicting back to its budget",
    "decode_evict": "(c) Decode step in which some requests evict one page of growth",
}


def attention_bytes(s: Shapes, context: int, rows: int, queries: int) -> int:
    """K and V read once, queries read and outputs written: the traffic floor of one layer's attention."""
    return 2 * rows * context * s.kv_heads * s.head_size * s.element + 2 * rows * queries * s.query_heads * \
        s.head_size * s.element


# ---- timing ---------------------------------------------------------------------------------------
@dataclass
class Timing:
    device_us: float  # CUDA events around the launches (host gaps included); wall time on CPU
    host_us: float  # wall time of the Python calls that launch the work, without waiting for it


class Timer:
    def __init__(self, device: torch.device, reps: int, warmup: int) -> None:
        self.device, self.reps, self.warmup = device, reps, warmup

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object], setup: Callable[[], None] | None = None) -> Timing:
        """Median over ``reps`` calls of ``fn``; ``setup`` (untimed) runs before every call."""
        for _ in range(self.warmup):
            if setup is not None:
                setup()
            fn()
        device, host = [], []
        cuda = self.device.type == "cuda"
        for _ in range(self.reps):
            if setup is not None:
                setup()
            self.sync()
            if cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            launched = time.perf_counter() - t0
            if cuda:
                stop.record()
                stop.synchronize()
                device.append(start.elapsed_time(stop) * 1e3)
            else:
                device.append(launched * 1e6)
            host.append(launched * 1e6)
        return Timing(statistics.median(device), statistics.median(host))


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """GB/s of a device-to-device copy, read + write counted: this run's bandwidth ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (t.device_us * 1e-6) / 1e9


# ---- a synthetic batch over a paged cache -----------------------------------------------------------
class PagedKV:
    """One layer's K/V pages for ``rows`` requests of up to ``context`` tokens, laid out as vLLM's
    FLASH_ATTN backend stores them ([pages, page_size, H_kv, 2 * d], K and V the two halves of the last
    axis, seen through [pages, H_kv, page_size, d] views), pages shuffled over the pool, page 0 the null
    page. Every layer's ``LayerCache`` shares these K/V tensors: the record phase never reads them, and
    only layer 0 evicts (one layer of 64 x 32k tokens is 8 GiB; the step is scaled to all layers)."""

    def __init__(self, s: Shapes, context: int, device: torch.device, seed: int = 0) -> None:
        self.shapes, self.context, self.device = s, context, device
        gen = torch.Generator().manual_seed(seed)
        self.pages_per_row = -(-context // s.page_size)
        self.num_pages = 1 + s.rows * self.pages_per_row
        order = torch.randperm(self.num_pages - 1, generator=gen) + 1
        self.table = order.view(s.rows, self.pages_per_row).numpy().astype(np.int64)  # the host copy
        self.block_table = torch.from_numpy(self.table).to(device=device, dtype=torch.int32)  # as vLLM's
        torch.manual_seed(seed)
        self.raw = torch.randn(self.num_pages, s.page_size, s.kv_heads, 2 * s.head_size, dtype=s.dtype,
                               device=device)
        self.k, self.v = self.raw.transpose(1, 2).split(s.head_size, dim=-1)
        self.o_proj = torch.randn(s.layers, s.hidden, s.query_heads * s.head_size, dtype=s.dtype,
                                  device=device) * s.hidden ** -0.5

    def slot_positions(self) -> tuple[Tensor, Tensor]:
        """(pages [R * P], positions [R * P, page_size]): position = slot index in every row's pages."""
        s = self.shapes
        pages = self.block_table.long().reshape(-1)
        slots = torch.arange(self.pages_per_row * s.page_size, device=self.device, dtype=torch.int32)
        return pages, slots.view(1, self.pages_per_row, s.page_size).expand(s.rows, -1, -1).reshape(-1, s.page_size)


@dataclass
class StepInputs:
    """What vanilla vLLM has for a step before any hook runs: the attention's q/k/v, the slot mapping
    and the positions of the step's tokens on the device, the per-token row bookkeeping on the host.
    (vLLM's attention also writes the step's K/V into their slots; here those slots already hold random
    K/V, which costs the step nothing either way.)"""

    query: Tensor  # [T, H_q * d]
    key: Tensor  # [T, H_kv * d]
    value: Tensor
    slot_mapping: Tensor  # int64 [T]
    positions: Tensor  # int64 [T]
    token_rows: np.ndarray  # [T]
    in_row: np.ndarray  # [T]
    query_start: np.ndarray  # [R]

    @classmethod
    def build(cls, kv: PagedKV, sc: Scenario) -> "StepInputs":
        s, device = kv.shapes, kv.device
        t = sc.num_tokens
        token_rows = np.repeat(np.arange(len(sc.scheduled)), sc.scheduled)
        query_start = np.concatenate([[0], np.cumsum(sc.scheduled)[:-1]]).astype(np.int64)
        in_row = np.arange(t) - query_start[token_rows]
        slots = sc.computed[token_rows] + in_row  # physical: nothing evicted before this step
        mapping = kv.table[token_rows, slots // s.page_size] * s.page_size + slots % s.page_size
        rand = lambda heads: torch.randn(t, heads * s.head_size, dtype=s.dtype, device=device)  # noqa: E731
        return cls(query=rand(s.query_heads), key=rand(s.kv_heads), value=rand(s.kv_heads),
                   slot_mapping=torch.from_numpy(mapping).to(device),
                   positions=torch.from_numpy(sc.computed[token_rows] + in_row).to(device),
                   token_rows=token_rows, in_row=in_row, query_start=query_start)


class EvictionStep:
    """The engine's eviction step for one policy (the server's), on ``kv`` with the engine's buffers."""

    def __init__(self, kv: PagedKV, policy: Policy) -> None:
        s = kv.shapes
        self.kv, self.policy = kv, policy
        geometry = Geometry(layers=s.layers, num_pages=kv.num_pages, kv_heads=s.kv_heads, page_size=s.page_size,
                            query_heads=s.query_heads, head_size=s.head_size, max_rows=s.rows, dtype=s.dtype,
                            device=kv.device)
        # A fixed-mode server's buffers: the policy's states (its window mass among them), no query ring.
        self.buffers = buffers = EvictionBuffers(geometry, Layout(states=policy.state_names,
                                                                  head_states=policy.head_state_names))
        for state in buffers.states.values():
            state.uniform_()  # accumulated attention and window mass, value norms: any non-negative values
        self.caches = [
            LayerCache(index=i, k=kv.k, v=kv.v, positions=buffers.positions[i],
                       state={name: b[i] for name, b in buffers.states.items()}, ring=None,
                       scale=s.head_size ** -0.5, o_proj=kv.o_proj[i] if policy.needs_o_proj else None)
            for i in range(s.layers)]

    def reset(self, sc: Scenario) -> None:
        """The cache as it is before ``sc``: every slot's position is its index (no eviction yet)."""
        pages, positions = self.kv.slot_positions()
        self.buffers.positions[:, pages] = positions.view(1, -1, 1, positions.shape[-1])

    def window(self, sc: Scenario, rows: np.ndarray) -> WindowStep | None:
        """The rows' accumulated window in this step, as the engine's step builder decides it
        (``schedule.window_end``): the evicting rows read it, decode rows one page short of their
        eviction (budget + slack = the context) add their query to it, a prompt end its last queries."""
        policy, page = self.policy, self.kv.shapes.page_size
        if not policy.accumulates_window:
            return None
        n = len(rows)
        cached = sc.computed[rows] + sc.scheduled[rows]
        prompt = cached if sc.phase is not Phase.DECODE else np.full(n, 1, dtype=np.int64)
        end = window_end(cached_after=cached, scheduled=sc.scheduled[rows], logical_after=cached, prompt=prompt,
                         evicting=sc.keep[rows] >= 0, budget=np.full(n, sc.context - page),
                         slack=np.full(n, page), one_shot=np.full(n, policy.one_shot),
                         at_prompt_end=np.full(n, policy.window_at_prompt_end),
                         in_decode=np.full(n, policy.window_in_decode))
        recorded = end.recorded(cached, sc.scheduled[rows], policy.window_size(end.logical, end.kept))
        gain = policy.window_gain(end.logical, end.kept, self.kv.shapes.head_size)
        return WindowStep(recorded=recorded, count=recorded, gain=gain,
                          reset=bool(end.now[0]))

    def plan(self, sc: Scenario, inp: StepInputs) -> tuple[StepPlan, list[Policy]]:
        """``StepBuilder.build`` for this batch: the record of the step's tokens and one ``build_group``
        per kind of acting rows (evicting, or updating every step). Not included: its fix-up of vLLM's
        ``seq_lens`` and slot mapping for rows that evicted before (a few ops on [R] and [T] tensors)."""
        kv, buffers, policy = self.kv, self.buffers, self.policy
        page = kv.shapes.page_size
        record = Record(pages=inp.slot_mapping // page, offsets=inp.slot_mapping % page,
                        positions=inp.positions.to(torch.int32), ring_index=None)
        initializers, zero_states = state_initializers([policy])
        step = StepPlan(record=record, groups=[], ring_positions=None, zero_states=zero_states)
        lengths = sc.computed + sc.scheduled
        evicting = sc.keep >= 0
        acting = evicting | policy.needs_every_step | policy.accumulates_window
        for kind in (False, True):
            rows = np.nonzero(acting & (evicting == kind))[0]
            if not len(rows):
                continue
            pages = -(-int(lengths[rows].max()) // page)
            index = torch.from_numpy(rows.astype(np.int64)).to(kv.device, non_blocking=True)
            table = kv.block_table[:, :pages].index_select(0, index)
            step.groups.append(build_group(
                policy, sc.phase, table, page, lengths=lengths[rows], computed=sc.computed[rows],
                scheduled=sc.scheduled[rows], seed=np.zeros(len(rows), dtype=np.int64),
                keep=sc.keep[rows] if kind else None, ring_rows=None, token_starts=inp.query_start[rows],
                window=self.window(sc, rows)))
        return step, initializers

    def record(self, plan: StepPlan, initializers: list[Policy], inp: StepInputs) -> None:
        """The record phase of every layer: ``record_step`` once, then each layer's hook."""
        record_step(self.buffers.positions, self.buffers.states, plan)
        for cache in self.caches:
            record_layer(cache, plan, initializers, inp.query, inp.key, inp.value)

    def evict(self, plan: StepPlan, inp: StepInputs) -> list[Tensor | None]:
        """The evict phase of layer 0 (every layer runs the same on its own pages)."""
        s = self.kv.shapes
        return evict_layer(self.caches[0], plan, tokens_view(inp.query, len(inp.token_rows), s.query_heads,
                                                              s.head_size))

    def snapshot(self, sc: Scenario) -> Callable[[], None] | None:
        """A restore of what layer 0's evict phase overwrites in the evicting rows (K, V, positions,
        states), so that every timed call compacts the same cache; None when nothing is compacted."""
        rows = np.nonzero(sc.keep >= 0)[0]
        if not len(rows):
            return None
        pages = self.kv.block_table[torch.from_numpy(rows).to(self.kv.device)].long().reshape(-1)
        tensors = [self.kv.raw, self.buffers.positions[0], *(b[0] for b in self.buffers.states.values())]
        saved = [t[pages] for t in tensors]  # advanced indexing copies

        def restore() -> None:
            for t, copy in zip(tensors, saved):
                t[pages] = copy

        return restore


# ---- measurement -----------------------------------------------------------------------------------
@dataclass
class KernelRow:
    case: KernelCase
    backend: str
    rows: int
    bytes: int
    flops: int
    us: float | None = None


@dataclass
class StepRow:
    scenario: str
    policy: str
    context: int
    rows: int
    evicting: int
    kept: int  # tokens per head the evicting rows keep (0: none evicts)
    plan_us: float | None = None
    record_us: float | None = None  # record_step + record_layer of every layer
    evict_us: float | None = None  # evict_layer of one layer (None: no group acts)
    host_us: float | None = None  # host time of launching the whole step
    attention_us: float | None = None  # the step's attention over every layer (vanilla stand-in)
    attention_bytes: int = 0  # traffic floor of that attention, every layer
    layers: int = 1
    acts: bool = False  # some group acts (evicts or updates): the evict phase runs

    @property
    def step_us(self) -> float | None:
        if self.plan_us is None or self.record_us is None:
            return None
        return self.plan_us + self.record_us + self.layers * (self.evict_us or 0.0)


@dataclass
class Results:
    shapes: Shapes
    measured: bool
    device: str = UNMEASURED
    device_type: str = ""  # "cuda" or "cpu" when measured
    environment: str = ""
    copy_gbs: float | None = None
    kernels: list[KernelRow] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def on_cpu(self) -> bool:
        return self.device_type == "cpu"

    @property
    def missing(self) -> str:
        """What a cell without a number says: nothing was measured, or this measurement failed."""
        return "failed" if self.measured else UNMEASURED


def available_backends(device: torch.device) -> tuple[set[str], list[str]]:
    notes = []
    backends = {"torch"}
    if device.type == "cuda" or ops.interpreting():
        if ops.triton_available():
            backends.add("triton")
        else:
            notes.append("Triton is not installed: no Triton timings.")
    else:
        notes.append("Triton kernels skipped: on CPU they run only in the interpreter (set TRITON_INTERPRET=1).")
    if device.type == "cuda":
        if ops.cuda_extension() is not None:
            backends.add("cuda")
        else:
            from vllm_evict import csrc

            notes.append(f"CUDA extension unavailable ({csrc.load_error()}): no CUDA-kernel timings.")
    return backends, notes


def kernel_call(case: KernelCase, backend: str, rows: int, kv: PagedKV, positions: Tensor) -> Callable[[], object]:
    """One ``ops`` call of ``case`` over the first ``rows`` requests of ``kv``."""
    s, device = kv.shapes, kv.device
    n = case.context
    table = kv.block_table[:rows]
    lengths = torch.full((rows,), n, dtype=torch.int64, device=device)
    if case.op == "window_mass":
        queries = torch.randn(rows, s.window, s.query_heads, s.head_size, dtype=s.dtype, device=device)
        qpos = (n - s.window + torch.arange(s.window, device=device)).expand(rows, -1).contiguous()
        per_head = case.variant == "per query head"
        if case.variant.startswith("added"):  # the engine's window step: the mass added into its paged state
            state = torch.zeros(positions.shape, dtype=torch.float32, device=device)
            return lambda: ops.accumulate_window_mass(state, kv.k, table, lengths, queries, qpos, s.head_size ** -0.5,
                                                      positions=positions, width=n, backend=backend)
        return lambda: ops.window_mass(kv.k, table, lengths, queries, qpos, s.head_size ** -0.5, positions=positions,
                                       width=n, per_query_head=per_head, backend=backend)
    if case.op == "keydiff_scores":
        return lambda: ops.keydiff_scores(kv.k, table, lengths, width=n, backend=backend)
    if case.op == "output_error":
        alpha = torch.softmax(torch.randn(rows, s.kv_heads, n, device=device), dim=-1)
        return lambda: ops.output_error(kv.v, table, lengths, alpha, backend=backend)
    if case.op == "compact_tokens":
        kept = n // 2  # the last half of every row: every kept slot moves, each call moves the same
        keep = torch.arange(n - kept, n, device=device).expand(rows, s.kv_heads, -1).contiguous()
        counts = torch.full((rows,), kept, dtype=torch.int64, device=device)
        return lambda: ops.compact_tokens([kv.k, kv.v, positions], table, keep, counts, backend=backend)
    if case.op == "value_norms":
        values = torch.randn(s.kv_heads, case.tokens, s.head_size, dtype=s.dtype, device=device)
        return lambda: ops.value_norms(values, kv.o_proj[0], backend=backend)
    raise KeyError(case.op)


def attempt(res: Results, what: str, fn: Callable[[], object]) -> object | None:
    """``fn()``, or None with a note when it fails on a GPU: one failed measurement (an out-of-memory, a
    kernel that refuses a shape) must not lose the others. On CPU (the smoke run) it raises."""
    try:
        return fn()
    except Exception as exc:
        if res.on_cpu:
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        res.notes.append(f"{what} failed: {type(exc).__name__}: {first}")
        release(res.device_type)
        return None


def measure_kernels(res: Results, kv: PagedKV, timer: Timer, backends: set[str], cases: list[KernelCase]) -> None:
    s = kv.shapes
    positions = torch.zeros(kv.num_pages, s.kv_heads, s.page_size, dtype=torch.int32, device=kv.device)
    pages, slot_pos = kv.slot_positions()
    positions[pages] = slot_pos.view(-1, 1, s.page_size)
    for case in cases:
        for backend in case.backends():
            if backend not in backends:
                continue
            rows = s.torch_rows if backend == "torch" and case.op != "value_norms" else s.rows
            row = KernelRow(case, backend, rows, kernel_bytes(case, s, rows), kernel_flops(case, s))
            what = f"{case.op} ({case.variant or 'scores'}, {_ctx(case.context)}, {backend})"
            t = attempt(res, what, lambda: timer(kernel_call(case, backend, rows, kv, positions)))
            row.us = t.device_us if isinstance(t, Timing) else None
            res.kernels.append(row)


def attention_call(s: Shapes, context: int, queries: int, device: torch.device) -> tuple[Callable[[], object], str]:
    """One layer's attention for the step and what it is: ``queries`` per request at the last positions
    of ``context`` keys (causal, aligned bottom-right), the query heads over the KV heads without
    repeating K/V (``enable_gqa``); torch SDPA picks its fastest kernel (flash attention on Hopper). Where
    SDPA refuses GQA, K/V are repeated over the group (slower: the ratios then flatter eviction)."""
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(s.rows, s.query_heads, queries, s.head_size, dtype=s.dtype, device=device)
    k = torch.randn(s.rows, s.kv_heads, context, s.head_size, dtype=s.dtype, device=device)
    v = torch.randn_like(k)
    mask = None if queries == 1 else causal_lower_right(queries, context)  # decode: the query sees every key
    try:
        sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        return (lambda: sdpa(q, k, v, attn_mask=mask, enable_gqa=True)), "torch SDPA, GQA"
    except Exception as exc:  # noqa: BLE001 - whatever SDPA raises, the repeated K/V path is plain attention
        k, v = k.repeat_interleave(s.group, dim=1), v.repeat_interleave(s.group, dim=1)
        return (lambda: sdpa(q, k, v, attn_mask=mask)), f"torch SDPA, K/V repeated ({str(exc)[:120]})"


def measure_attention(res: Results, kv: PagedKV, timer: Timer, queries: int) -> float | None:
    """One layer's attention of the step (``queries`` per request) in microseconds."""
    def run() -> float:
        fn, how = attention_call(kv.shapes, kv.context, queries, kv.device)
        label = f"Attention stand-in, {queries} queries per request: {how}."
        if label not in res.notes:
            res.notes.append(label)
        return timer(fn).device_us

    out = attempt(res, f"attention ({queries} queries, {_ctx(kv.context)})", run)
    release(res.device_type)  # its dense K/V copies
    return out if isinstance(out, float) else None


def measure_step(row: StepRow, step: EvictionStep, sc: Scenario, timer: Timer) -> None:
    """Fill ``row`` with the timings of one step: plan, record (every layer), evict (layer 0)."""
    inp = StepInputs.build(step.kv, sc)
    step.reset(sc)
    plan_t = timer(lambda: step.plan(sc, inp))
    plan, initializers = step.plan(sc, inp)
    record_t = timer(lambda: step.record(plan, initializers, inp))
    host = plan_t.host_us + record_t.host_us
    if plan.groups:
        evict_t = timer(lambda: step.evict(plan, inp), setup=step.snapshot(sc))
        row.evict_us = evict_t.device_us
        host += row.layers * evict_t.host_us
    row.plan_us, row.record_us, row.host_us = plan_t.device_us, record_t.device_us, host


def measure_steps(res: Results, kv: PagedKV, timer: Timer, budget: int | None) -> None:
    s = kv.shapes
    scenario_list = scenarios(s, kv.context, budget)
    attention = {q: measure_attention(res, kv, timer, q)
                 for q in sorted({int(sc.scheduled[0]) for sc in scenario_list})}
    for spec in POLICIES:
        policy = EvictionConfig.from_spec(spec, budget=min_budget(scenario_list)).build_policy()
        step = attempt(res, f"{spec} buffers ({_ctx(kv.context)})", lambda: EvictionStep(kv, policy))
        for sc in scenario_list:
            row = scenario_row(s, sc, spec)
            per_layer = attention[int(sc.scheduled[0])]
            row.attention_us = None if per_layer is None else s.layers * per_layer
            if isinstance(step, EvictionStep):
                attempt(res, f"{spec} step {sc.key} ({_ctx(kv.context)})", lambda: measure_step(row, step, sc, timer))
            res.steps.append(row)
        del step
        release(res.device_type)  # this policy's buffers


def min_budget(scenario_list: list[Scenario]) -> int:
    kept = [int(sc.keep[sc.keep >= 0].min()) for sc in scenario_list if (sc.keep >= 0).any()]
    return min(kept)


def scenario_row(s: Shapes, sc: Scenario, spec: str) -> StepRow:
    policy = EvictionConfig.from_spec(spec, budget=int(sc.context)).build_policy()
    acts = sc.evicting > 0 or policy.needs_every_step
    kept = int(sc.keep.max()) if sc.evicting else 0
    return StepRow(sc.key, spec, sc.context, len(sc.computed), sc.evicting, kept, layers=s.layers, acts=acts,
                   attention_bytes=s.layers * attention_bytes(s, sc.context, len(sc.computed), int(sc.scheduled[0])))


def release(device_type: str) -> None:
    """Give the GPU memory of the last measurement back before the next one allocates (a no-op on CPU,
    where collecting would cost more than the tiny shapes' measurements)."""
    if device_type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def measure(s: Shapes, device: torch.device, reps: int, warmup: int, budget: int | None) -> Results:
    import triton

    timer = Timer(device, reps, warmup)
    backends, notes = available_backends(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores visible)"
    res = Results(shapes=s, measured=True, device=name, device_type=device.type, notes=notes,
                  environment=f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
    res.copy_gbs = copy_bandwidth(device, timer, (1 << 30) if device.type == "cuda" else (32 << 20))
    if device.type == "cuda":
        res.notes.append("Backends the engine step picks (`ops.describe()`): "
                         + ", ".join(f"{op} {b}" for op, b in ops.describe().items()) + ".")
    cases = kernel_cases(s)
    for context in s.contexts:
        kv = attempt(res, f"the paged cache ({_ctx(context)})", lambda: PagedKV(s, context, device))
        if not isinstance(kv, PagedKV):
            continue
        measure_kernels(res, kv, timer, backends, [c for c in cases if c.context == context])
        if context == s.contexts[0]:
            measure_kernels(res, kv, timer, backends, [c for c in cases if c.context == 0])
        measure_steps(res, kv, timer, budget)
        del kv
        release(device.type)
    return res


def skeleton(s: Shapes, budget: int | None) -> Results:
    """Every row the measurement writes, with the computed byte counts and nothing timed."""
    res = Results(shapes=s, measured=False)
    cases = kernel_cases(s)
    for context in (*s.contexts, 0):
        for case in (c for c in cases if c.context == context):
            for backend in case.backends():
                rows = s.torch_rows if backend == "torch" and case.op != "value_norms" else s.rows
                res.kernels.append(KernelRow(case, backend, rows, kernel_bytes(case, s, rows), kernel_flops(case, s)))
    for context in s.contexts:
        for spec in POLICIES:
            for sc in scenarios(s, context, budget):
                res.steps.append(scenario_row(s, sc, spec))
    return res


# ---- the report ------------------------------------------------------------------------------------
def _ctx(n: int) -> str:
    return "-" if n == 0 else f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _us(x: float | None, missing: str) -> str:
    return missing if x is None else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def _num(x: float | None, missing: str = UNMEASURED) -> str:
    """A size or rate: grouped thousands from 100 up, three significant digits below."""
    return missing if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x: float | None, missing: str, digits: int = 1) -> str:
    return missing if x is None else f"{100 * x:.{digits}f}%"


def _verdict(value: float | None, target: float, below: bool, missing: str) -> str:
    if value is None:
        return missing
    return "met" if (value <= target if below else value >= target) else "missed"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def kernel_lines(res: Results) -> list[str]:
    copy, miss = res.copy_gbs, res.missing
    memory, compute = [], []
    for k in res.kernels:
        c = k.case
        gbs = None if k.us is None else k.bytes / (k.us * 1e-6) / 1e9
        frac = None if gbs is None or copy is None else gbs / copy
        if c.op == "value_norms":
            tflops = None if k.us is None else k.flops / (k.us * 1e-6) / 1e12
            compute.append([c.variant, str(c.tokens), k.backend, _us(k.us, miss), _num(k.flops / 1e9),
                            _num(tflops, miss), _num(k.bytes / 2**20)])
            continue
        target = "-" if k.backend == "torch" else _verdict(frac, BANDWIDTH_TARGET, False, miss)
        memory.append([c.op, c.variant or "-", _ctx(c.context), str(k.rows), k.backend, _us(k.us, miss),
                       _num(k.bytes / 2**20), _num(gbs, miss), _pct(frac, miss, 0), target])
    return [
        "## Kernels (one layer, one call)",
        "",
        "Every `vllm_evict.ops` operation at the batch's shapes: `rows` requests, each with `context` candidate "
        f"slots (window: {res.shapes.window} queries). *MiB moved*: the traffic of the kernel as designed, read + "
        "written (both passes of a two-pass kernel read the keys or values; `compact_tokens` keeps the last half "
        "of every row of K, V and positions, so every kept slot moves). *of copy*: achieved GB/s over the copy "
        f"bandwidth above; target for the compiled kernels >= {BANDWIDTH_TARGET:.0%}. The PyTorch reference "
        f"gathers K/V densely; it is timed at {res.shapes.torch_rows} rows, for scale only.",
        "",
        *_table(["op", "variant", "context", "rows", "backend", "time (us)", "MiB moved", "GB/s", "of copy",
                 f">= {BANDWIDTH_TARGET:.0%}"], memory),
        "",
        "`value_norms` (CriticalKV's nu of the step's new tokens) multiplies them by the layer's output projection: "
        "compute-bound, so it is given in TFLOP/s.",
        "",
        *_table(["value_norms", "tokens", "backend", "time (us)", "GFLOP", "TFLOP/s", "MiB moved"], compute),
        "",
    ]


def step_lines(res: Results) -> list[str]:
    s = res.shapes
    copy, miss = res.copy_gbs, res.missing
    out = [
        "## The engine's eviction step",
        "",
        f"Per step, over all {s.layers} layers: *plan* builds the `StepPlan` (the record of the step's tokens, "
        "`build_group` for the acting rows; host arrays, a few host-to-device copies); *record* is `record_step` "
        f"plus `record_layer` in each of the {s.layers} layers (positions, zeroed and computed per-token state); "
        "*evict* is `evict_layer` in one layer: the window queries' attention added to the window mass, then "
        "scoring and compacting (or, for h2o, updating the accumulated attention of) the acting rows; "
        f"*step* = plan + record + {s.layers} x evict. *host*: the "
        "time the Python calls of the whole step take to launch it (on a GPU, work queues behind it; on the "
        "critical path when the device is idle). *attention*: torch SDPA of the same step over the same "
        f"contexts ({s.layers} layers), the stand-in for vanilla vLLM's step. The real step also runs the "
        "projections, MLP and sampling (more time), while vLLM's own attention kernel may beat SDPA's (less); "
        "so for decode steps *step / floor* also compares the step with the least time any decode attention "
        "can take: its K/V bytes at the copy bandwidth.",
        "",
        "Every layer's `LayerCache` has its own positions and states (the engine's `EvictionBuffers` of a "
        "fixed-mode server, which keeps no queries), and shares one layer's K/V pages; layer 0's evict phase is timed on a cache "
        "restored before every call, and scaled to all layers.",
        "",
    ]
    for key, title in SCENARIO_TITLES.items():
        rows = [r for r in res.steps if r.scenario == key]
        if not rows:
            continue
        out += [f"### {title}", ""]
        if key == "decode":
            out += [f"Target: the record phase of a decode step <= {RECORD_TARGET:.0%} of vanilla's step. h2o is "
                    "not only recorded: its accumulated attention is updated on every step (the evict column), "
                    "so it is held to no target here.", ""]
        elif key == "chunk":
            out += [f"Each of the {s.rows} requests adds a {s.chunk}-token chunk at the end of its context and keeps "
                    "*kept* tokens per head (by default its context minus the chunk: a chunked-prefill request whose "
                    "cache was full, or the last chunk of a one-shot policy's prompt). Target: the whole eviction "
                    f"step <= {CHUNK_TARGET:.0%} of the chunk's attention. h2o adds the chunk's full attention to "
                    "its state, an attention-sized pass.", ""]
        else:
            out += [f"{s.evicting_rows} of {s.rows} requests are at their budget + one page and evict it; the "
                    "others only record.", ""]
        header = ["policy", "context", "evicting", "kept", "plan (us)", f"record, {s.layers} layers (us)",
                  "evict, 1 layer (us)", "step (us)", "host (us)", f"attention, {s.layers} layers (us)",
                  "step / attention"]
        if key != "chunk":
            header.append("step / floor")
        header.append("target")
        table = []
        for r in rows:
            ratio = None if r.step_us is None or r.attention_us is None else r.step_us / r.attention_us
            cells = [r.policy, _ctx(r.context), f"{r.evicting} of {r.rows}", f"{r.kept:,}" if r.kept else "-",
                     _us(r.plan_us, miss),
                     _us(r.record_us, miss), _us(r.evict_us, miss) if r.acts else "-", _us(r.step_us, miss),
                     _us(r.host_us, miss), _us(r.attention_us, miss), _pct(ratio, miss, 2)]
            if key != "chunk":
                floor_us = None if copy is None else r.attention_bytes / (copy * 1e9) * 1e6
                cells.append(_pct(None if r.step_us is None or floor_us is None else r.step_us / floor_us, miss, 2))
            if key == "decode":
                cells.append("-" if r.acts else _verdict(ratio, RECORD_TARGET, True, miss))
            elif key == "chunk":
                cells.append(_verdict(ratio, CHUNK_TARGET, True, miss))
            else:
                cells.append("-")
            table.append(cells)
        out += [*_table(header, table), ""]
    return out


def preference_lines(res: Results) -> list[str]:
    """The faster compiled backend of each op (group-sum window_mass: the variant CUDA takes), summed over
    the contexts."""
    out = ["## Backend preference", ""]
    if not res.measured:
        return out + [f"{UNMEASURED}. Until measured: CUDA for compact_tokens and window_mass (when the extension "
                      "builds), Triton for the others (`vllm_evict.ops.DEFAULT_PREFERENCE`)."]
    if res.on_cpu:
        return out + ["Not derived from a CPU run (there the Triton kernels run in the interpreter)."]
    totals: dict[str, dict[str, float]] = {}
    for k in res.kernels:
        if k.backend != "torch" and k.us is not None and k.case.variant != "per query head":
            totals.setdefault(k.case.op, {}).setdefault(k.backend, 0.0)
            totals[k.case.op][k.backend] += k.us
    best = {op: min(t, key=t.get) for op, t in totals.items()}
    spec = ",".join(f"{op}={b}" for op, b in best.items())
    return out + [*_table(["op", "faster backend (summed over contexts)"], [[op, b] for op, b in best.items()]), "",
                  f"Apply with `VLLM_EVICT_KERNELS=\"{spec}\"` or `vllm_evict.ops.set_preference`."]


def render(res: Results, command: str) -> str:
    s = res.shapes
    if res.measured:
        status = [f"Measured with `{command}`. Do not edit the numbers by hand: run the command again."]
        if res.on_cpu:
            status.append("This is a CPU smoke run on tiny shapes: it checks the code path, its times say nothing "
                          "about a GPU.")
    else:
        status = [f"**Unmeasured.** No GPU was available to produce this file, so it is the skeleton that "
                  f"`{DRY_RUN_COMMAND}` writes: every time, bandwidth and ratio reads `{UNMEASURED}`; only the "
                  "byte and FLOP counts, which follow from the shapes, are filled in. To measure, run "
                  f"`{GPU_COMMAND}` from the repository root on a machine with one CUDA GPU (written for an 80 GB "
                  "H100: the 32k cases hold a few copies of one layer's 8 GiB of K/V) after `make install`, which "
                  "installs `vllm==0.33.0` there; it rewrites this file with the figures."]
    commands = [(GPU_COMMAND, "on a CUDA GPU: measure, write docs/benchmarks/kernels.md"),
                (DRY_RUN_COMMAND, "the skeleton, without a GPU"), (SMOKE_COMMAND, "CPU smoke run, tiny shapes")]
    width = max(len(cmd) for cmd, _ in commands)
    lines = [
        "# Eviction kernels and the eviction step on a GPU",
        "",
        *status,
        "",
        "```bash",
        *(f"{cmd:<{width}}  # {what}" for cmd, what in commands),
        "```",
        "",
        "## Set-up",
        "",
        f"- device: {res.device}" + (f"; {res.environment}" if res.environment else ""),
        "- copy bandwidth: " + (res.missing if res.copy_gbs is None else
                                f"{res.copy_gbs:,.0f} GB/s (device-to-device copy, read + write counted)"),
        f"- shapes: {s.name}, {s.layers} layers, {s.kv_heads} KV heads, {s.query_heads} query heads, head size "
        f"{s.head_size}, hidden {s.hidden}, {str(s.dtype).replace('torch.', '')}, pages of {s.page_size} tokens "
        f"(FLASH_ATTN layout, shuffled); {s.rows} requests; contexts "
        f"{', '.join(_ctx(c) for c in s.contexts)}; prefill chunk {s.chunk}",
        "- times: median of the timed calls; on a GPU, CUDA events around the calls (host gaps included)",
        *(f"- {note}" for note in res.notes),
        "",
        *kernel_lines(res),
        *step_lines(res),
        *preference_lines(res),
    ]
    return "\n".join(lines) + "\n"


# ---- command line ----------------------------------------------------------------------------------
def python_command() -> str:
    """This interpreter as the report's command should name it: relative to the checkout when it is the
    project's environment."""
    try:
        return str(Path(sys.executable).relative_to(ROOT))
    except ValueError:
        return "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"report file (default: {DEFAULT_OUT.relative_to(ROOT)}; --small: stdout)")
    parser.add_argument("--dry-run", action="store_true", help="write the skeleton: nothing measured")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where to measure (cuda)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke run of the code path)")
    parser.add_argument("--budget", type=int, default=None,
                        help="tokens kept per head in scenario (b) (default: the context minus the chunk)")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per measurement (10; --small: 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (2; --small: 1)")
    args = parser.parse_args(argv)
    shapes = SMALL if args.small else LLAMA_8B
    if args.budget is not None and not 0 < args.budget < min(shapes.contexts) - shapes.chunk + 1:
        parser.error(f"--budget must be between 1 and {min(shapes.contexts) - shapes.chunk} (the smallest context "
                     "minus the chunk), or left out")
    for spec in POLICIES if args.budget is not None else ():
        try:
            EvictionConfig.from_spec(spec, budget=args.budget).build_policy()
        except ValueError as exc:
            parser.error(f"--budget {args.budget} does not suit {spec}: {exc}")
    if args.dry_run:
        text = render(skeleton(shapes, args.budget), DRY_RUN_COMMAND)
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print(f"benchmarks/kernels.py measures on a CUDA GPU and none is visible here (torch {torch.__version__})."
                  f" On a GPU machine run: {GPU_COMMAND}\n(--dry-run writes the skeleton; --device cpu --small "
                  "runs the code path on tiny shapes.)", file=sys.stderr)
            return 2
        if device.type == "cpu" and not args.small:
            parser.error("--device cpu needs --small: the full shapes need tens of GB of accelerator memory")
        if device.type == "cuda":
            os.environ.pop("TRITON_INTERPRET", None)
        reps = args.reps or (1 if args.small else 10)
        warmup = args.warmup if args.warmup is not None else (1 if args.small else 2)
        command = " ".join([python_command(), "benchmarks/kernels.py", *(argv if argv is not None else sys.argv[1:])])
        if device.type == "cpu" and ops.interpreting():
            command = "TRITON_INTERPRET=1 " + command
        text = render(measure(shapes, device, reps, warmup, args.budget), command)
    out = args.out if args.out is not None else (None if args.small else DEFAULT_OUT)
    if out is None:
        sys.stdout.write(text)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
