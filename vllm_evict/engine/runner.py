"""Worker side: a mixin over vLLM's V1 model runner (GPU runner and its CPU subclass).

- Right after each attention layer has run, requests the scheduler marked for eviction are scored by
  their policy and compacted in place: every KV head keeps the planned number of tokens in the first
  slots of the request's pages, together with their per-token state.
- At the start of the next step the block table is truncated to the pages still in use, and the
  request's evicted count grows.
- While preparing inputs, RoPE positions stay logical; ``seq_lens`` and ``slot_mapping`` become
  physical, so attention reads exactly the compacted cache and new tokens land after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from vllm_evict import ops
from vllm_evict.config import EvictionConfig
from vllm_evict.engine.layout import KVViews, probe_kv_layout
from vllm_evict.engine.paged_kernels import PagedScoreKernels
from vllm_evict.engine.plan import PLAN_ATTR, EvictionPlan, RequestStep
from vllm_evict.engine.step_timer import StepTimer  # [metrics]
from vllm_evict.policies.base import Deferred, EvictionInputs, Policy

logger = logging.getLogger("vllm.vllm_evict")  # under "vllm" so vLLM's log handlers print it

POSITIONS = "__positions__"  # per-token logical position, stored like any policy state


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BatchRow:
    """One request of the current step, as the attention hooks need it."""

    request_id: str
    step: RequestStep
    policy: Policy
    query_start: int
    block_ids: Tensor  # pages holding the request's tokens after this step

    @property
    def query_stop(self) -> int:
        return self.query_start + self.step.num_new


@dataclass
class QueryWindow:
    queries: Tensor  # [H_q, w, d]
    positions: Tensor  # [w]


@dataclass
class EvictionWorkerState:
    evicted: dict[str, int] = field(default_factory=dict)  # request id -> logical - physical tokens
    compacted: dict[str, RequestStep] = field(default_factory=dict)  # evicted during the last step
    windows: dict[tuple[str, int], QueryWindow] = field(default_factory=dict)  # (request, layer) -> queries
    policies: dict[str, Policy] = field(default_factory=dict)  # config json -> policy instance
    last_step: dict[str, RequestStep] = field(default_factory=dict)
    # When a dict (tests), the logical positions each finished request kept, per layer [H_kv, n].
    kept_record: dict[str, list[Tensor]] | None = None

    def forget(self, request_id: str) -> None:
        self.evicted.pop(request_id, None)
        self.compacted.pop(request_id, None)
        self.last_step.pop(request_id, None)
        for key in [k for k in self.windows if k[0] == request_id]:
            del self.windows[key]

    def request_ids(self) -> set[str]:  # [metrics] reported as a gauge: must be empty once the server is idle
        return {*self.evicted, *self.compacted, *self.last_step, *(key[0] for key in self.windows)}


class EvictRunnerMixin:
    """Put in front of vLLM's GPUModelRunner (or CPUModelRunner) by class swap, see worker.py."""

    # ---- set-up ------------------------------------------------------------------------------
    def evict_init(self) -> None:
        self.evict_state = EvictionWorkerState()
        self.evict_batch: list[BatchRow] | None = None
        self.evict_layers: dict[str, int] = {}
        self.evict_views: KVViews | None = None
        self.evict_state_buffers: dict[str, dict[str, Tensor]] = {}
        self.evict_layout = ""
        self.evict_o_proj: dict[str, Tensor] = {}  # layer name -> output projection weight
        self.evict_timer = StepTimer(self.device)  # type: ignore[attr-defined]  # [metrics] eviction time per step

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)  # type: ignore[misc]
        self._install_attention_hooks()

    def _install_attention_hooks(self) -> None:
        context = self.compilation_config.static_forward_context  # type: ignore[attr-defined]
        layers = [(name, module) for name, module in context.items()
                  if hasattr(module, "impl") and isinstance(getattr(module, "kv_cache", None), Tensor)
                  and module.kv_cache.numel() > 0]
        for index, (name, module) in enumerate(layers):
            impl = module.impl
            if self.evict_views is None:
                self.evict_layout, self.evict_views = probe_kv_layout(
                    impl, module, module.kv_cache, impl.num_kv_heads, impl.head_size)
                logger.info("vllm_evict: KV layout of %s is %s", type(impl).__name__, self.evict_layout)
            self.evict_layers[name] = index
            original = impl.forward
            impl.forward = self._make_hook(name, module, original)
        if not layers:
            raise ValueError("KV eviction found no attention layers with a paged KV cache in this model")

    def _make_hook(self, layer_name: str, module: torch.nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward_then_evict(layer: Any, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                               attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if self.evict_batch and attn_metadata is not None:
                with self.evict_timer:  # [metrics]
                    self._evict_layer(layer_name, module, query, key, value, kv_cache)
            return result

        return forward_then_evict

    # ---- step bookkeeping ----------------------------------------------------------------------
    def _update_states(self, scheduler_output: Any) -> Any:
        state = self.evict_state
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        gone |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        table = self.input_batch.block_table[0]  # type: ignore[attr-defined]
        page = table.block_size
        for request_id, step in state.compacted.items():
            request = self.requests.get(request_id)  # type: ignore[attr-defined]
            if request is None or request_id in gone:
                continue
            kept_pages = _cdiv(step.keep, page)
            del request.block_ids[0][kept_pages:]
            row = self.input_batch.req_id_to_index.get(request_id)  # type: ignore[attr-defined]
            if row is not None:
                held = int(table.num_blocks_per_row[row])
                table.block_table.np[row, kept_pages:held] = 0
                table.num_blocks_per_row[row] = min(held, kept_pages)
            state.evicted[request_id] = step.tokens_before + step.num_new - step.keep
        state.compacted.clear()
        if state.kept_record is not None:
            for request_id in scheduler_output.finished_req_ids:
                if request_id in state.last_step and request_id in self.requests:  # type: ignore[attr-defined]
                    state.kept_record[request_id] = self.kept_positions(request_id)
        for request_id in gone:
            state.forget(request_id)
        return super()._update_states(scheduler_output)  # type: ignore[misc]

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        plan: EvictionPlan | None = getattr(scheduler_output, PLAN_ATTR, None)
        self.evict_batch = None
        if plan is None:
            return result
        num_reqs = self.input_batch.num_reqs  # type: ignore[attr-defined]
        request_ids = self.input_batch.req_ids[:num_reqs]  # type: ignore[attr-defined]
        evicted = np.array([self.evict_state.evicted.get(r, 0) for r in request_ids], dtype=np.int64)
        if evicted.any():
            self._make_lengths_physical(scheduler_output, num_scheduled_tokens, evicted)
        self.evict_batch = self._batch_rows(plan, request_ids)
        return result

    def _make_lengths_physical(self, scheduler_output: Any, num_scheduled: np.ndarray, evicted: np.ndarray) -> None:
        """Attention reads the physical length; new tokens are written after the compacted ones."""
        num_reqs = len(evicted)
        total = scheduler_output.total_num_scheduled_tokens
        device = self.seq_lens.device  # type: ignore[attr-defined]
        shift = torch.from_numpy(evicted)
        self.seq_lens[:num_reqs] -= shift.to(device, self.seq_lens.dtype)  # type: ignore[attr-defined]
        upper = self.optimistic_seq_lens_cpu  # type: ignore[attr-defined]
        upper[:num_reqs] -= shift.to(upper.dtype)
        per_token = torch.from_numpy(np.repeat(evicted, num_scheduled[:num_reqs])).to(device)
        positions = self.positions[:total]  # type: ignore[attr-defined]
        physical = positions - per_token.to(positions.dtype)
        self.input_batch.block_table.compute_slot_mapping(  # type: ignore[attr-defined]
            num_reqs, self.query_start_loc.gpu[: num_reqs + 1], physical)  # type: ignore[attr-defined]

    def _batch_rows(self, plan: EvictionPlan, request_ids: list[str]) -> list[BatchRow]:
        rows = []
        starts = self.query_start_loc.np  # type: ignore[attr-defined]
        table = self.input_batch.block_table[0]  # type: ignore[attr-defined]
        for index, request_id in enumerate(request_ids):
            step = plan.steps.get(request_id)
            if step is None:
                continue
            computed = int(self.input_batch.num_computed_tokens_cpu[index])  # type: ignore[attr-defined]
            phys_before = computed - self.evict_state.evicted.get(request_id, 0)
            if computed != step.tokens_before or phys_before != step.phys_before:
                raise RuntimeError(
                    f"vllm_evict: worker and scheduler disagree on request {request_id}: worker has "
                    f"{computed} tokens ({phys_before} cached), scheduler planned {step.tokens_before} "
                    f"({step.phys_before} cached)")
            pages = _cdiv(step.phys_after, table.block_size)
            block_ids = torch.from_numpy(table.block_table.np[index, :pages].astype(np.int64)).to(self.device)  # type: ignore[attr-defined]
            rows.append(BatchRow(request_id=request_id, step=step, policy=self._policy_for(step.config),
                                 query_start=int(starts[index]), block_ids=block_ids))
            if step.keep is not None:
                self.evict_state.compacted[request_id] = step
            self.evict_state.last_step[request_id] = step
        return rows

    def kept_positions(self, request_id: str) -> list[Tensor]:
        """Logical positions cached for a request, per layer [H_kv, n] in slot order (tests, debugging)."""
        step = self.evict_state.last_step[request_id]
        length = step.keep if step.keep is not None else step.phys_after
        block_ids = torch.tensor(self.requests[request_id].block_ids[0], dtype=torch.int64, device=self.device)  # type: ignore[attr-defined]
        return [ops.gather_tokens(self.evict_state_buffers[name][POSITIONS], block_ids, length).clone()
                for name in self.evict_layers]

    def _policy_for(self, config: EvictionConfig) -> Policy:
        key = str(config)
        policy = self.evict_state.policies.get(key)
        if policy is None:
            policy = self.evict_state.policies[key] = config.build_policy()
        return policy

    # ---- per layer ----------------------------------------------------------------------------
    def _state_buffer(self, layer_name: str, name: str, like: Tensor) -> Tensor:
        """Per-token state of one layer, paged like the KV cache: [num_blocks, H_kv, block_size]."""
        buffers = self.evict_state_buffers.setdefault(layer_name, {})
        if name not in buffers:
            dtype = torch.int64 if name == POSITIONS else torch.float32
            buffers[name] = torch.zeros(like.shape[:3], dtype=dtype, device=like.device)
        return buffers[name]

    def _evict_layer(self, layer_name: str, module: Any, query: Tensor, key: Tensor, value: Tensor,
                     kv_cache: Tensor) -> None:
        impl = module.impl
        num_heads, num_kv_heads, head_size = impl.num_heads, impl.num_kv_heads, impl.head_size
        k_view, v_view = self.evict_views(kv_cache)  # type: ignore[misc]
        layer_index = self.evict_layers[layer_name]
        query = query.view(-1, num_heads, head_size)
        key = key.view(-1, num_kv_heads, head_size)
        value = value.view(-1, num_kv_heads, head_size)
        o_proj: Tensor | None = None
        for row in self.evict_batch or ():
            step, policy = row.step, row.policy
            span = slice(row.query_start, row.query_stop)
            new_keys, new_values = key[span].transpose(0, 1), value[span].transpose(0, 1)  # [H_kv, m, d]
            new_positions = torch.arange(step.tokens_before, step.tokens_before + step.num_new, device=key.device)
            if policy.needs_o_proj and o_proj is None:
                o_proj = self._o_proj_weight(layer_name, query.dtype)
            positions_buffer = self._state_buffer(layer_name, POSITIONS, k_view)
            ops.write_tokens(positions_buffer, row.block_ids, step.phys_before, new_positions.expand(num_kv_heads, -1))
            n = step.phys_after
            kernels = PagedScoreKernels(
                k_cache=k_view, v_cache=v_view, positions=positions_buffer, block_ids=row.block_ids, length=n,
                new_start=step.phys_before,
                state_buffer=lambda name: self._state_buffer(layer_name, name, k_view))
            new_state = policy.init_state(new_keys, new_values, o_proj if policy.needs_o_proj else None, kernels)
            for name, values in new_state.items():
                buffer = self._state_buffer(layer_name, name, k_view)
                ops.write_tokens(buffer, row.block_ids, step.phys_before, values)
            window = self._update_query_window(row, layer_index, query[span].transpose(0, 1), new_positions)
            if step.keep is None and not policy.needs_every_step:
                continue
            buffers = {name: self._state_buffer(layer_name, name, k_view) for name in (POSITIONS, *policy.state_names)}
            gathered = {name: ops.gather_tokens(buf, row.block_ids, n) for name, buf in buffers.items()}
            inputs = EvictionInputs(
                # K and V are gathered only if the policy reads them beyond what ``kernels`` computes.
                keys=Deferred(partial(ops.gather_tokens, k_view, row.block_ids, n)),
                values=Deferred(partial(ops.gather_tokens, v_view, row.block_ids, n)),
                positions=gathered.pop(POSITIONS), queries=window.queries, query_positions=window.positions,
                scale=float(impl.scale), seq_len=step.tokens_before + step.num_new, num_new=step.num_new,
                phase=step.phase, state=gathered, layer=layer_index, seed=step.config.seed,
                o_proj=o_proj if policy.needs_o_proj else None, kernels=kernels)
            result = policy.step(inputs, step.keep)
            for name in policy.state_names:
                ops.write_tokens(buffers[name], row.block_ids, 0, result.state[name])
            if result.keep is not None:
                ops.compact_tokens([k_view, v_view, *buffers.values()], row.block_ids, result.keep)

    def _update_query_window(self, row: BatchRow, layer_index: int, queries: Tensor, positions: Tensor) -> QueryWindow:
        """The last ``policy.query_window`` queries of the request, across decode steps."""
        wanted = row.policy.query_window
        if wanted is None:
            return QueryWindow(queries, positions)
        if wanted == 0:
            return QueryWindow(queries[:, :0], positions[:0])
        key = (row.request_id, layer_index)
        previous = self.evict_state.windows.get(key)
        if previous is not None and queries.shape[1] < wanted:
            queries = torch.cat([previous.queries, queries], dim=1)
            positions = torch.cat([previous.positions, positions])
        window = QueryWindow(queries[:, -wanted:].clone(), positions[-wanted:].clone())
        self.evict_state.windows[key] = window
        return window

    def _o_proj_weight(self, layer_name: str, dtype: torch.dtype) -> Tensor:
        """This layer's output projection [hidden, H_q * d] on this rank (CriticalKV projects values
        through it), read once per layer and remembered."""
        cached = self.evict_o_proj.get(layer_name)
        if cached is not None:
            return cached
        prefix = layer_name.rsplit(".", 1)[0]
        model = self.get_model()  # type: ignore[attr-defined]
        try:
            module = model.get_submodule(prefix + ".o_proj")
        except AttributeError as err:
            raise ValueError(f"this policy needs the output projection of {layer_name}, but the model has no "
                             f"{prefix}.o_proj; choose a policy without criticalkv") from err
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor) and weight.dim() == 2 and weight.numel() > 0 and weight.is_floating_point():
            result = weight
        else:
            result = _weight_from_linear(module, dtype)
        self.evict_o_proj[layer_name] = result
        return result


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
