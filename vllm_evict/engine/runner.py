"""Worker side: the eviction runner, a mixin over vLLM's model runner (V1 or Model Runner V2, GPU or
its CPU subclass). This module holds what both runners share; engine/runner_v1.py and
engine/runner_v2.py hook each runner's own step, through a ``RunnerView`` (engine/runner_view.py).

Per step:
1. before vLLM updates its request states: the pages the scheduler freed after last step's eviction
   leave the block table, and each compacted row's evicted count grows (engine/rows.py keeps such
   per-row numbers in step with vLLM's row moves); elastic compressions run;
2. once vLLM has prepared the step's inputs: RoPE positions stay logical; the sequence lengths attention
   sees and the slot mapping become physical, so attention reads exactly the compacted cache and new
   tokens land after it; the step's ``StepPlan`` is built once (engine/step_builder.py) and the
   positions of the new tokens are recorded;
3. after each attention layer, the hook runs that layer's eviction step (``vllm_evict.evict_step``):
   record the new tokens' state and queries, then, for the rows the scheduler marked, score, select
   and compact in place, batched over rows.

Nothing here knows any eviction method: the policies live in ``vllm_evict/policies``.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from vllm_evict.engine.buffers import (
    EvictionBuffers, Geometry, Layout, bytes_per_token, eviction_bytes, kv_share, layout_for,
)
from vllm_evict.engine.layout import probe_kv_layout
from vllm_evict.guards import fp8_storage_dtype
from vllm_evict.engine.plan import PLAN_ATTR, EvictionPlan
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.rows import PolicyTable, RowTable
from vllm_evict.engine.runner_view import RunnerView
from vllm_evict.engine.step_builder import BuiltStep, StepBuilder, compress_before_forward, return_window_pages
from vllm_evict.engine.step_timer import StepTimer
from vllm_evict.engine.warmup import WarmupGeometry, warm_up_in_vllm, warm_up_server
from vllm_evict.engine.window_lender import query_group
from vllm_evict.engine.window_pages import pages_for_window, slot_row_view
from vllm_evict.evict_step import LayerCache, copy_pages, evict_layer, record_layer, tokens_view
from vllm_evict.kv_shard import KVShard
from vllm_evict.paged import gather_tokens
from vllm_evict.policies.base import Policy

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it

HOOK_ATTR = "__vllm_evict_original__"  # set on an installed hook: the forward it wraps


def server_eviction_mapping(vllm_config: Any) -> dict[str, Any] | None:
    """The server-wide eviction settings exactly as the user gave them (additional_config)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    mapping = extra.get("kv_eviction")
    return dict(mapping) if mapping else None


def _is_profiling(method: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """The ``is_profiling`` argument of an ``initialize_kv_cache`` call, however it was passed."""
    try:
        bound = inspect.signature(method).bind_partial(*args, **kwargs)
    except TypeError:
        return bool(kwargs.get("is_profiling", False))
    return bool(bound.arguments.get("is_profiling", False))


class EvictRunnerMixin:
    """What eviction does the same way in both of vLLM's model runners. Not used alone: worker.py puts
    ``EvictV1RunnerMixin`` (engine/runner_v1.py) or ``EvictV2RunnerMixin`` (engine/runner_v2.py) in
    front of the runner by class swap; they hook the runner's own steps and provide its ``RunnerView``."""

    evict_view: RunnerView

    def _make_view(self) -> RunnerView:
        raise NotImplementedError

    def _track_rows(self, rows: RowTable) -> None:
        """Make vLLM's row additions, removals and moves reach ``rows`` (engine/rows.py)."""
        raise NotImplementedError

    def _guard_cuda_graphs(self) -> bool:
        """Keep full CUDA graphs off the steps with layer work (engine/cuda_graphs.py); False: the runner
        picks no graphs."""
        raise NotImplementedError

    # ---- set-up ------------------------------------------------------------------------------
    def evict_init(self) -> None:
        self.evict_view = self._make_view()
        self.evict_server = server_eviction_mapping(self.vllm_config)  # type: ignore[attr-defined]
        self.evict_policies = PolicyTable()
        self.evict_rows: RowTable | None = None
        self.evict_buffers: EvictionBuffers | None = None
        self.evict_builder: StepBuilder | None = None
        self.evict_layers: list[LayerCache] = []
        self.evict_layer_names: list[str] = []
        self.evict_step: BuiltStep | None = None
        # The scheduler's word that some layer has eviction work in the running step: no full CUDA graph
        # (engine/cuda_graphs.py). Set at the start of a scheduled step, cleared at its end.
        self.evict_layer_step = False
        self.evict_compactions: list = []
        self.evict_relocations: dict[str, list[int]] = {}  # request id -> its page list from the next step
        self.evict_layout = ""
        # When a dict (tests), the logical positions each finished request kept, per layer [H_kv, n].
        self.evict_kept_record: dict[str, list[Tensor]] | None = None
        self.evict_timer = StepTimer(self.device)  # type: ignore[attr-defined]  # eviction time per step (metrics)

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        # vLLM 0.33 also builds a throw-away cache to profile CUDA-graph memory (is_profiling=True):
        # hooking it would install the hooks twice, so every layer would evict twice per step.
        if _is_profiling(super().initialize_kv_cache, args, kwargs):  # type: ignore[misc]
            return
        self._install_eviction()

    def _use_slot_rows(self) -> None:
        """Window queries as rows of the KV storage where every layer has them at the same row numbers
        (engine/window_pages.py); otherwise through the K and V views."""
        found = [slot_row_view(cache.k, cache.v) for cache in self.evict_layers]
        if any(f is None for f in found) or len({f[0] for f in found if f is not None}) != 1:
            logger.info("vllm_evict: window queries go through the K/V views (the layout has no slot rows)")
            return
        for cache, (_, view) in zip(self.evict_layers, found):  # type: ignore[misc]
            cache.slot_rows = view
        self.evict_builder.slot_rows = found[0][0]  # type: ignore[index]

    def _attention_layers(self) -> list[tuple[str, Any]]:
        context = self.compilation_config.static_forward_context  # type: ignore[attr-defined]
        return [(name, module) for name, module in context.items()
                if hasattr(module, "impl") and isinstance(getattr(module, "kv_cache", None), Tensor)
                and module.kv_cache.numel() > 0]

    def _install_eviction(self) -> None:
        layers = self._attention_layers()
        if not layers:
            raise ValueError("KV eviction found no attention layers with a paged KV cache in this model")
        first = layers[0][1]
        fp8 = fp8_storage_dtype(self.cache_config.cache_dtype)  # type: ignore[attr-defined]
        model_dtype = self.model_config.dtype  # type: ignore[attr-defined]
        self.evict_layout, views = probe_kv_layout(first.impl, first, first.kv_cache, first.impl.num_kv_heads,
                                                   first.impl.head_size, fp8=fp8, input_dtype=model_dtype)
        logger.info("vllm_evict: KV layout of %s is %s", type(first.impl).__name__, self.evict_layout)
        k0, _ = views(first.kv_cache)
        manager_page = self.cache_config.block_size  # type: ignore[attr-defined]
        if k0.shape[2] != manager_page:
            # vLLM splits a manager block into several kernel blocks for some backends; the scheduler
            # frees manager blocks, so the two must be the same page.
            raise ValueError(
                f"KV eviction needs the attention backend's kernel block size ({k0.shape[2]} tokens) to equal "
                f"the KV cache block size ({manager_page}); start the server with --block-size {k0.shape[2]}")
        geometry = Geometry(layers=len(layers), num_pages=k0.shape[0], kv_heads=k0.shape[1], page_size=k0.shape[2],
                            query_heads=first.impl.num_heads, head_size=first.impl.head_size,
                            max_rows=self.evict_view.max_rows,
                            dtype=model_dtype if fp8 is not None else first.kv_cache.dtype,
                            device=first.kv_cache.device)
        self.evict_buffers = buffers = EvictionBuffers(geometry, self.evict_buffer_layout())
        logger.info("vllm_evict: eviction's buffers hold %.1f MiB (states %s, query ring %d queries)",
                    buffers.nbytes / 2**20, ", ".join(buffers.states) or "none", buffers.window)
        self.evict_rows = rows = RowTable(geometry.max_rows, self.evict_server, self.evict_policies,
                                          on_new_policy=self._on_new_policy, on_new_slot=buffers.reset_slot)
        self._track_rows(rows)
        # The widest decode window a request may have (max_window) sizes every loan of window pages.
        rows.size_window_pages(pages_for_window(self.evict_policies.window_cap or 0,
                                                query_group(self.model_config), geometry.page_size))  # type: ignore[attr-defined]
        self.evict_builder = StepBuilder(rows, buffers, geometry.device)
        shard = self._kv_shard(geometry.kv_heads)
        self.evict_layers, self.evict_layer_names = [], []
        for index, (name, module) in enumerate(layers):
            k, v = views(module.kv_cache)
            self.evict_layers.append(LayerCache(index=index, k=k, v=v, positions=buffers.positions[index],
                                                state={n: b[index] for n, b in buffers.states.items()},
                                                ring=buffers.ring[index] if buffers.ring is not None else None,
                                                scale=float(module.impl.scale),
                                                head_offset=shard.head_offset if shard is not None else 0, shard=shard,
                                                k_scale=module._k_scale if fp8 is not None else None,
                                                v_scale=module._v_scale if fp8 is not None else None))
            self.evict_layer_names.append(name)
            impl = module.impl
            original = getattr(impl.forward, HOOK_ATTR, impl.forward)  # never wrap a hook in a hook
            impl.forward = self._make_hook(index, original)
        if fp8 is None:  # window pages are not lent over an fp8 cache (engine/window_lender.py)
            self._use_slot_rows()
        if self._guard_cuda_graphs():
            logger.info("vllm_evict: full CUDA graphs run on steps without eviction work in any layer")
        if self.evict_server is not None:
            server = _server_config(self.evict_server)
            self._on_new_policy(server, self.evict_policies.policies[self.evict_policies.index_of(server)])
            self._load_reserved_o_proj()
        from vllm_evict import csrc, ops

        # Built (or found missing) now, not inside the first eviction's forward on every rank at once.
        if csrc.load_extension() is None and geometry.device.type == "cuda":
            logger.warning("vllm_evict: the CUDA eviction kernels are unavailable (%s); their operations run "
                           "on Triton", csrc.load_error())
        logger.info("vllm_evict: kernels per operation: %s",
                    ", ".join(f"{op}={backend}" for op, backend in ops.describe(geometry.device).items()))
        if geometry.device.type == "cuda" and os.environ.get("VLLM_EVICT_WARMUP", "1") != "0":
            # In vLLM's kernel warm-up, before its JIT monitor starts watching (engine/warmup.py).
            enabled = bool(getattr(getattr(self.vllm_config, "kernel_config", None),  # type: ignore[attr-defined]
                                   "enable_jit_warmup", False))
            if not warm_up_in_vllm(getattr(self, "jit_warmup_registry", None), enabled, self.evict_warm_up):
                self.evict_warm_up()

    def evict_warm_up(self) -> None:
        """Compile every eviction kernel variant any request can need, now (engine/warmup.py)."""
        cache, name = self.evict_layers[0], self.evict_layer_names[0]
        geometry = WarmupGeometry(k=cache.k, v=cache.v, query_heads=self.evict_buffers.geometry.query_heads,
                                  scale=cache.scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                  dtype=self.evict_buffers.geometry.dtype)

        def o_proj() -> Tensor | None:
            try:
                return self._o_proj_weight(name, self.evict_buffers.geometry.dtype)
            except ValueError as err:  # e.g. an fp8 checkpoint: CriticalKV is refused on it
                logger.info("vllm_evict: no CriticalKV kernels to compile: %s", err)
                return None

        warm_up_server(geometry, o_proj)

    def _load_reserved_o_proj(self) -> None:
        """Every layer's output projection, at start-up, when a method the server reserves needs it
        (``Reservation.o_proj``): a model without one refuses to start instead of failing a request."""
        from vllm_evict.request_settings import server_settings

        settings = server_settings(self.evict_server)
        if settings is None or not settings[1].o_proj or self.evict_buffers is None:
            return
        try:
            for cache, name in zip(self.evict_layers, self.evict_layer_names):
                if cache.o_proj is None:
                    cache.o_proj = self._o_proj_weight(name, self.evict_buffers.geometry.dtype)
        except ValueError as err:
            specs = [settings[0].eviction.policy, *settings[0].request_policies]
            raise ValueError(f"{err} (the server reserves it for {', '.join(specs)}: drop criticalkv from "
                             f"--kv-eviction and from request_policies)") from None

    def _on_new_policy(self, config: EvictionConfig, policy: Policy) -> None:
        """A config not seen before: check that the buffers reserved at start-up serve it (the front end
        refuses a request that needs more), and read its weights."""
        buffers = self.evict_buffers
        if buffers is None:
            return
        missing = buffers.missing(policy.state_names, policy.head_state_names,
                                  policy.window_for(config.budget) if config.elastic else 0)
        if missing is not None:
            raise ValueError(f"vllm_evict: {config.policy} needs {missing}, which this server did not reserve at "
                             "start-up (the front end refuses such requests)")
        if policy.needs_o_proj:
            for cache, name in zip(self.evict_layers, self.evict_layer_names):
                if cache.o_proj is None:
                    cache.o_proj = self._o_proj_weight(name, buffers.geometry.dtype)

    def _kv_shard(self, local_heads: int) -> KVShard | None:
        """This rank's KV heads under tensor parallelism (None without it): which global heads it holds
        and, when KV heads are replicated over ranks, the TP group's all-reduce that completes the sums
        over a query-head group (vllm_evict/kv_shard.py)."""
        try:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
            from vllm.distributed.parallel_state import get_tp_group

            rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:  # not initialised (tests without a distributed context)
            return None
        if world == 1:
            return None
        total = self.model_config.get_total_num_kv_heads()  # type: ignore[attr-defined]
        shard = KVShard.of_rank(rank, world, total, get_tp_group().all_reduce)
        if shard.local_kv_heads != local_heads:
            raise ValueError(f"KV eviction expected {shard.local_kv_heads} KV heads on tensor-parallel rank {rank} "
                             f"of {world} ({total} in the model), the KV cache has {local_heads}")
        return shard

    def evict_buffer_layout(self) -> Layout:
        """What the buffers reserve at start-up (``buffers.layout_for``)."""
        return layout_for(self.evict_server)

    def evict_kv_share(self, available: int) -> int:
        """The part of ``available`` KV-cache bytes left for K and V once eviction's buffers are counted:
        the query ring (elastic servers), and per token the position and the reserved states, in
        proportion to the K/V bytes of that token."""
        if self.evict_server is None:
            return available
        model, parallel = self.model_config, self.parallel_config  # type: ignore[attr-defined]
        layers = model.get_num_layers(parallel)
        kv_heads, query_heads = model.get_num_kv_heads(parallel), model.get_num_attention_heads(parallel)
        head_size = model.get_head_size()
        dtype = self.kv_cache_dtype if isinstance(getattr(self, "kv_cache_dtype", None), torch.dtype) else model.dtype
        if fp8_storage_dtype(self.cache_config.cache_dtype) is not None:  # type: ignore[attr-defined]
            dtype = torch.uint8  # one byte per element, whatever type vLLM allocates it as
        element = torch.tensor([], dtype=dtype).element_size()
        layout = self.evict_buffer_layout()
        rows = self.scheduler_config.max_num_seqs  # type: ignore[attr-defined]
        ring = eviction_bytes(layers=layers, kv_heads=kv_heads, query_heads=query_heads, head_size=head_size,
                              element=torch.tensor([], dtype=model.dtype).element_size(), layout=layout,
                              pool_tokens=0, rows=rows)  # the ring holds queries: the model's dtype
        ours = bytes_per_token(layers, kv_heads, max(query_heads // max(kv_heads, 1), 1), layout)
        share = kv_share(available, kv_per_token=layers * kv_heads * head_size * 2 * element, ours_per_token=ours,
                         fixed=ring)
        logger.info("vllm_evict: %.1f MiB of the KV cache memory (%.2f%%) hold eviction's buffers (query ring "
                    "%.1f MiB, %d bytes per cached token)", (available - share) / 2**20,
                    100 * (available - share) / max(available, 1), ring / 2**20, ours)
        return share

    # ---- step bookkeeping (shared; each runner's mixin calls these from its own hooks) ------------
    def _begin_step(self, scheduler_output: Any) -> EvictionPlan | None:
        """Before vLLM updates its request states: last step's compactions reach the block table, and
        elastic compressions run before anything is written into the pages they give back. The step's
        host-to-device copies take the next staging turn (one per engine step: vllm_evict/staging.py)."""
        if self.evict_builder is not None:
            self.evict_builder.staging.begin_step()
        self._apply_compactions(scheduler_output)
        plan: EvictionPlan | None = getattr(scheduler_output, PLAN_ATTR, None)
        self.evict_layer_step = plan is not None and plan.layer_work
        if plan is None or self.evict_rows is None:
            return plan
        if plan.compress or plan.window_returned:  # a pre-forward pass, before the forward writes anything
            with self.evict_timer:
                if plan.compress:
                    compress_before_forward(self, plan)
                if plan.window_returned:
                    return_window_pages(self, plan.window_returned)
        for request_id, pages in plan.window_pages.items():
            self.evict_rows.lend_window_pages(request_id, pages)
        return plan

    def _apply_compactions(self, scheduler_output: Any) -> None:
        """Last step compacted these requests and the scheduler has freed their tail pages: drop those
        pages from the block table (new pages are appended after the kept ones) and count the tokens."""
        rows, view = self.evict_rows, self.evict_view
        page_size = self.evict_buffers.geometry.page_size
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        relocated, self.evict_relocations = self.evict_relocations, {}
        for request_id, pages in relocated.items():  # copies of shared pages (prefix caching)
            if request_id not in gone:  # also a V1 request left out of this step: its block ids
                view.set_pages(request_id, view.row_of(request_id), pages)
        for compaction in self.evict_compactions:
            row = view.row_of(compaction.request_id)
            if row is None:
                continue
            rows.evicted[row] = compaction.logical - compaction.keep
            rows.cached[row] = compaction.keep
            if compaction.request_id not in gone:
                view.truncate_pages(compaction.request_id, row, -(-compaction.keep // page_size))
        self.evict_compactions = []
        if self.evict_kept_record is not None:
            for request_id in scheduler_output.finished_req_ids:
                if view.row_of(request_id) is not None:  # one that finished as it copied reads the copies
                    self.evict_kept_record[request_id] = self.kept_positions(request_id, relocated.get(request_id))

    def _build_step(self, plan: EvictionPlan | None, num_scheduled_tokens: np.ndarray) -> None:
        """Once vLLM has prepared this step's inputs: physical lengths, and the plan every layer runs."""
        if plan is None or self.evict_builder is None:
            self.evict_step = None
            return
        step = self.evict_builder.build(self.evict_view, plan, num_scheduled_tokens)
        if step is not None and step.layer_work and not plan.layer_work:
            # A full CUDA graph may be replaying this step: its layers would skip the work.
            raise RuntimeError("vllm_evict: this step has per-layer eviction work (window queries, states, "
                               "evictions or copies) that the scheduler's plan did not foresee "
                               f"(evicting: {sorted(plan.keep)}, copies: {sorted(plan.copies)})")
        self.evict_compactions = step.compactions if step is not None else []
        self.evict_relocations = step.relocations if step is not None else {}
        self.evict_step = step

    def kept_positions(self, request_id: str, page_list: list[int] | None = None) -> list[Tensor]:
        """Logical positions cached for a request, per layer [H_kv, n] in slot order (tests, debugging);
        ``page_list``: its pages, where the block table does not hold them (yet)."""
        view = self.evict_view
        row = view.row_of(request_id)
        if row is None:
            raise KeyError(f"the worker holds no row for request {request_id}")
        length = int(self.evict_rows.cached[row])
        # A compaction of the last step reaches the rows with the next step: until then its length is this.
        length = next((c.keep for c in self.evict_compactions if c.request_id == request_id), length)
        pages = max(1, -(-length // self.evict_buffers.geometry.page_size))
        if page_list is None:
            table = view.page_table([request_id], pages, self.evict_builder.staging.to_device)
        else:
            table = torch.tensor([page_list[:pages]], dtype=torch.int32, device=self.evict_buffers.geometry.device)
        return [gather_tokens(cache.positions, table, length)[0].long().clone() for cache in self.evict_layers]

    # ---- per layer ----------------------------------------------------------------------------
    def _make_hook(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward_then_evict(layer: Any, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                               attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            step = self.evict_step
            # Timed (two CUDA events) only when the layer has work: most decode steps have none.
            if step is not None and attn_metadata is not None and step.layer_work:
                with self.evict_timer:
                    self._evict_layer(index, layer, step, query, key, value)
            return result

        setattr(forward_then_evict, HOOK_ATTR, original)
        return forward_then_evict

    def _evict_layer(self, index: int, layer: Any, step: BuiltStep, query: Tensor, key: Tensor,
                     value: Tensor) -> None:
        if not step.layer_work:  # a decode step far from any eviction: nothing per layer
            return
        cache = self.evict_layers[index]
        record_layer(cache, step.plan, step.initializers, query, key, value)
        if step.plan.copies is not None:  # after this step's tokens are in, before anything is written
            copy_pages(cache, step.plan.copies)
        if step.plan.groups:
            impl = layer.impl if hasattr(layer, "impl") else layer
            evict_layer(cache, step.plan, tokens_view(query, step.num_tokens, impl.num_heads, impl.head_size))

    def _o_proj_weight(self, layer_name: str, dtype: torch.dtype) -> Tensor:
        """This layer's output projection [hidden, H_q * d] on this rank (CriticalKV projects values
        through it), read once per layer."""
        prefix = layer_name.rsplit(".", 1)[0]
        model = self.get_model()  # type: ignore[attr-defined]
        try:
            module = model.get_submodule(prefix + ".o_proj")
        except AttributeError as err:
            raise ValueError(f"this policy needs the output projection of {layer_name}, but the model has no "
                             f"{prefix}.o_proj; choose a policy without criticalkv") from err
        return o_proj_matrix(module, f"{prefix}.o_proj", dtype)


def o_proj_matrix(module: Any, name: str, dtype: torch.dtype) -> Tensor:
    """The [hidden, H_q * d] matrix of an unquantized linear layer on this rank; ValueError for anything
    else. A quantized layer (fp8 stored transposed with its scales, packed integers, ...) is refused:
    its raw ``weight`` is not the matrix, and using it would select the wrong tokens silently (the
    front end refuses such models for CriticalKV first: ``guards.o_proj_unavailable``)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = getattr(module, "quant_method", None)
    weight = getattr(module, "weight", None)
    if method is not None and not isinstance(method, UnquantizedLinearMethod):
        raise ValueError(f"criticalkv needs the output projection in full precision, but {name} is quantized "
                         f"({type(method).__name__}); choose a method without criticalkv")
    if isinstance(weight, Tensor) and weight.dim() == 2 and weight.numel() > 0:
        if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"criticalkv needs the output projection in fp16/bf16/fp32, but {name} holds "
                             f"{weight.dtype} weights; choose a method without criticalkv")
        return weight
    return _weight_from_linear(module, dtype)


def _server_config(mapping: dict[str, Any]) -> Any:
    from vllm_evict.config import EvictionConfig

    return EvictionConfig.from_mapping(mapping)


def _weight_from_linear(module: Any, dtype: torch.dtype, rows: int = 1024) -> Tensor:
    """The effective weight [out, in] of a vLLM linear layer whose ``weight`` is not a plain matrix.

    vLLM's CPU backend repacks linear weights for oneDNN and leaves ``weight`` empty (quantized layers
    store theirs packed too). The layer's own matmul applied to the identity gives W^T exactly, without
    bias and, on a row-parallel layer, without the all-reduce, i.e. this rank's slice.
    """
    size = int(module.input_size_per_partition)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    parts = []
    for start in range(0, size, rows):  # a block of identity rows at a time bounds the memory
        count = min(rows, size - start)
        eye = torch.zeros(count, size, dtype=dtype, device=device)
        eye[torch.arange(count), torch.arange(start, start + count)] = 1
        parts.append(module.quant_method.apply(module, eye, bias=None))
    return torch.cat(parts).t().contiguous()
