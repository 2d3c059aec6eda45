"""Compile every kernel variant a server can launch while it starts, before it reports ready.

Triton compiles a kernel the first time it is launched with a new combination of constexprs, argument
dtypes and specialised integers, which takes seconds; in a running server that is a stall for every
request in the batch (and an error under vLLM's ``--jit-monitor-mode=error``). The per-step numbers
(widths, row strides, counts) are left unspecialised (``kernels._common.per_step_jit``), so the
variants a server can need are fixed by its model (dtype, head size, cache layout) and by the methods
requests may ask for: every method, since a request may name any of them (``kv_eviction`` in its
``vllm_xargs``).

``warm_up`` runs the real eviction step (``evict_step.record_layer`` and ``evict_layer``) of every
method, with the option values that take other kernel paths, in every phase, evicting and not, over
two rows that live in vLLM's null page, with the layer's own K/V views (so strides and dtypes are the
engine's). Whatever the ``ops`` dispatch picks on the device gets compiled, CUDA kernels aside (built
ahead of time). Each row keeps all its tokens, so the compacting kernels move nothing; positions and
states are scratch tensors. On CPU nothing needs compiling: the engine does not call it there, and
the tests call it under the Triton interpreter to check that it launches every variant a step does.

When it runs (``warm_up_in_vllm``): inside vLLM's own kernel warm-up, as one entry of the model runner's
JIT warm-up registry (``vllm.model_executor.warmup.jit_warmup``), which vLLM compiles in
``kernel_warmup`` before it activates its JIT monitor. Compiling any earlier is fine for the monitor too,
but then the log reads as if the kernels belonged to nobody's warm-up; later (after the monitor is
active) it would log each of our kernels as "JIT compilation during inference". Where vLLM has no such
registry, or its JIT warm-up is off (``--enforce-eager``: it expects compiles while serving and does not
monitor them), the warm-up runs at once, while the KV cache is set up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from vllm_evict.config import EvictionConfig
from vllm_evict.engine.window_pages import NO_PAGE
from vllm_evict.engine.window_pages import capacity as window_capacity
from vllm_evict.evict_step import (
    POSITION_DTYPE, LayerCache, Record, StepPlan, WindowStep, build_group, evict_layer, record_layer,
    state_initializers, tokens_view,
)
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
from vllm_evict.policies.base import WINDOW_MASS, WINDOW_MASS_HEADS, Phase
from vllm_evict.policies.caote import has_group_masses

logger = logging.getLogger("vllm.vllm_evict")

BUDGET = 256  # above what any method protects at its defaults; only the launch shapes depend on it
PHASES = (Phase.PREFILL, Phase.PROMPT_END, Phase.DECODE)
STATES = ("acc", "nu", "vnorm", "score", WINDOW_MASS)  # every per-token state a method keeps


def warmup_configs() -> list[EvictionConfig]:
    """Every method a request may name, with each option value that changes the kernels it launches:
    the per-query-head masses (SnapKV's max pooling, CAOTE's head mode), TOVA's group mean."""
    mass_bases = [b for b in BASE_POLICIES if load_class(b).is_attention_mass]
    specs: list[tuple[str, dict]] = [(b, {}) for b in BASE_POLICIES]
    specs += [(f"{m}+{b}", {}) for m in META_POLICIES for b in mass_bases]
    specs += [("snapkv", {"pooling": "max"}), ("tova", {"heads": "group"})]
    specs += [(f"{m}+{b}", {"caote_mode": "head"}) for m in ("caote", "fastcaote") for b in mass_bases
              if has_group_masses(load_class(b))]
    return [EvictionConfig.from_spec(spec, BUDGET, **options) for spec, options in specs]


@dataclass
class WarmupGeometry:
    """What the variants depend on: the layer's K/V views and the attention's shapes."""

    k: Tensor  # [num_pages, H_kv, bs, d] view of a layer's K cache (its page 0 is read)
    v: Tensor
    query_heads: int
    scale: float
    k_scale: Tensor | None = None  # an fp8 cache's per-layer scales (None: not quantized)
    v_scale: Tensor | None = None
    dtype: torch.dtype | None = None  # the queries' (the model's) dtype; None: the cache's

    @property
    def query_dtype(self) -> torch.dtype:
        return self.dtype if self.dtype is not None else self.k.dtype


def _qkv(tokens: int, g: WarmupGeometry) -> tuple[Tensor, Tensor, Tensor]:
    """query, key, value [T, H*d] as vLLM's attention gets them: views of one fused qkv projection."""
    h_kv, d = g.k.shape[1], g.k.shape[3]
    sizes = [g.query_heads * d, h_kv * d, h_kv * d]
    qkv = torch.ones(tokens, sum(sizes), dtype=g.query_dtype, device=g.k.device)  # values are irrelevant
    q, k, v = qkv.split(sizes, dim=-1)
    return q, k, v


def warm_up(g: WarmupGeometry, o_proj: Callable[[], Tensor | None] | None = None,
            configs: list[EvictionConfig] | None = None,
            to_device: Callable[..., list[Tensor]] | None = None) -> list[str]:
    """Run every method's eviction step once per (phase, evicting) over two null-page rows of ``g``;
    returns the specs skipped (CriticalKV when ``o_proj`` gives no weight). ``to_device``: the host-to-device
    copy of the steps' index arrays (``build_group``'s; None: pinned blocks of PyTorch's host allocator)."""
    device, page = g.k.device, g.k.shape[2]
    h_kv, d = g.k.shape[1], g.k.shape[3]
    k, v = g.k[:1], g.v[:1]  # the null page only (same strides as the whole cache), next to 1-page scratch buffers
    lengths = np.array([page + 3, 5], dtype=np.int64)  # two rows, one across a page boundary
    table = torch.zeros(2, 2, dtype=torch.int32, device=device)  # both rows in the null page
    positions = torch.zeros(1, h_kv, page, dtype=POSITION_DTYPE, device=device)
    states = {name: torch.zeros(1, h_kv, page, dtype=torch.float32, device=device) for name in STATES}
    group_size = g.query_heads // h_kv
    states[WINDOW_MASS_HEADS] = torch.zeros(1, h_kv, page, group_size, dtype=torch.float32, device=device)
    weight: Tensor | None = None
    skipped = []
    for config in configs or warmup_configs():
        policy = config.build_policy()
        if policy.needs_o_proj:
            weight = weight if weight is not None else (o_proj() if o_proj is not None else None)
            if weight is None:
                skipped.append(config.policy)
                continue
        window = policy.window_for(config.budget)
        ring = torch.ones(2, window, g.query_heads, d, dtype=g.query_dtype, device=device) if window else None
        ring_positions = torch.arange(2 * window, device=device).view(2, window) if window else None
        cache = LayerCache(index=0, k=k, v=v, positions=positions, state=states, ring=ring, scale=g.scale,
                           o_proj=weight if policy.needs_o_proj else None, k_scale=g.k_scale, v_scale=g.v_scale)
        initializers, zero_states = state_initializers([policy])
        # An elastic request's policy reads its window from the query ring ("ring"); a fixed-mode request's
        # window mass is accumulated as its queries arrive ("mass") or, with lent window pages, computed
        # from the queries waiting there when the window is read ("pages"; "mixed": a group with both).
        # No window pages are lent over an fp8 cache (engine/window_lender.py): no "pages" or "mixed" there.
        lent_modes = ("pages", "mixed") if g.k_scale is None else ()
        modes = ("ring", "mass", *lent_modes) if policy.accumulates_window else ("ring" if window else "none",)
        for phase, evicting, mode in ((p, e, m) for p in PHASES for e in (False, True) for m in modes):
            scheduled = np.array([1, 1] if phase is Phase.DECODE else [page, 4], dtype=np.int64)
            tokens = int(scheduled.sum())
            offsets = torch.arange(tokens, device=device) % page
            record = Record(pages=torch.zeros(tokens, dtype=torch.int64, device=device), offsets=offsets,
                            positions=offsets.to(POSITION_DTYPE), ring_index=None)
            accumulated = None
            if mode in ("mass", "pages", "mixed"):
                lent = np.zeros((2, 1), dtype=np.int64)  # the null page, lent to both rows
                if mode == "mixed":
                    lent[1] = NO_PAGE
                deferred = lent[:, 0] != NO_PAGE
                accumulated = WindowStep(recorded=scheduled, count=scheduled,
                                         gain=policy.window_gain(lengths, lengths, d), reset=evicting,
                                         lent=lent if mode != "mass" else None,
                                         queued=np.where(deferred, np.minimum(scheduled, 2), 0),
                                         capacity=window_capacity(np.ones(2, dtype=np.int64), group_size, page),
                                         group=group_size)
            group = build_group(policy, phase, table, page, lengths=lengths, computed=lengths - scheduled,
                                scheduled=scheduled, seed=np.zeros(2, dtype=np.int64),
                                keep=lengths if evicting else None,  # keep everything: nothing moves
                                ring_rows=np.arange(2) if mode == "ring" else None,
                                token_starts=np.array([0, scheduled[0]], dtype=np.int64), window=accumulated,
                                to_device=to_device)
            plan = StepPlan(record=record, groups=[group], ring_positions=ring_positions, zero_states=zero_states)
            query, key, value = _qkv(tokens, g)
            record_layer(cache, plan, initializers, query, key, value)
            evict_layer(cache, plan, tokens_view(query, tokens, g.query_heads, d))
    return skipped


WARMUP_KEY = "vllm_evict: every method's eviction kernels"


def warm_up_in_vllm(registry: Any, enabled: bool, warm: Callable[[], None]) -> bool:
    """Register ``warm`` with vLLM's JIT warm-up ``registry`` (the model runner's ``jit_warmup_registry``;
    ``enabled``: vLLM's ``kernel_config.enable_jit_warmup``), which runs it once in ``kernel_warmup``.
    Returns False, having run nothing, where that cannot be done: the caller warms up at once."""
    if registry is None or not enabled:
        return False
    try:
        from vllm.model_executor.warmup.jit_warmup import VllmJitKernel
    except ImportError:
        return False

    class EvictionKernels(VllmJitKernel):  # type: ignore[misc]
        """One compile key: the whole eviction warm-up (its variants are fixed by the model, not by vLLM)."""

        def get_warmup_keys(self) -> list[str]:
            return [WARMUP_KEY]

        def compile(self, compile_key: str) -> None:
            warm()

    with registry.activate():
        EvictionKernels().register_warmup()
    return True


def warm_up_server(g: WarmupGeometry, o_proj: Callable[[], Tensor | None]) -> None:
    """``warm_up`` at start-up, logged; the device is synchronised so that its time is the compile time."""
    start = time.perf_counter()
    skipped = warm_up(g, o_proj)
    if g.k.device.type == "cuda":
        torch.cuda.synchronize(g.k.device)
    logger.info("vllm_evict: eviction kernels of every method compiled in %.1f s before serving%s",
                time.perf_counter() - start, f" (skipped: {', '.join(skipped)})" if skipped else "")
