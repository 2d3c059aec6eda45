"""The HF reference runner: greedy generation with per-head KV eviction in plain transformers.

This is the oracle the vLLM integration must agree with. It runs one request, step by step, through
the very eviction step the engine runs (``vllm_evict.evict_step``), on a paged cache of its own:

* the prompt is fed in chunks of ``chunk_size`` tokens (or the given list of chunk sizes, to replay
  an engine's schedule), then one generated token per step;
* RoPE positions stay LOGICAL (``position_ids`` = logical positions) while the cache is physically
  shorter; every slot's logical position is kept per (layer, KV head) in the paged positions buffer;
* in every layer, the step's K/V are written into the request's next slots and the attention over
  the cache is computed in fp32 with a causal mask built from logical positions (HF's own mask and
  cache are not used);
* right after that layer's attention, the layer's eviction step runs (record, then evict when
  :func:`vllm_evict.schedule.eviction_target` says so), exactly as in the engine.

The hook is an attention function registered with transformers' ``AttentionInterface`` under the
name :data:`ATTN_IMPLEMENTATION`; it receives the post-RoPE queries, keys and values of the step.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from vllm_evict.config import EvictionConfig
from vllm_evict.evict_step import (
    POSITION_DTYPE, LayerCache, Record, StepPlan, WindowStep, build_group, dequantized_tokens, evict_layer,
    record_layer, record_step, ring_entries, state_initializers,
)
from vllm_evict.guards import check_kv_cache_dtype, fp8_storage_dtype
from vllm_evict.paged import as_bytes, gather_tokens
from vllm_evict.policies.base import Phase, Policy
from vllm_evict.schedule import eviction_target, phase_of, window_end

ATTN_IMPLEMENTATION = "vllm_evict_reference"
PAGE_SIZE = 16  # the reference's own page size; which tokens survive does not depend on it


@dataclass
class EvictionEvent:
    """One eviction in one layer."""

    step: int  # forward step (0 = first prompt chunk)
    layer: int
    phase: Phase
    seq_len: int  # logical tokens after the step
    phys_before: int  # cache length after appending this step's tokens
    kept: int  # cache length after eviction (the target)


@dataclass
class ReferenceResult:
    token_ids: list[int]  # generated tokens (the prompt excluded)
    logprobs: list[float]  # log-probability of each chosen token
    text: str  # decoded generation ("" without a tokenizer)
    kept_positions: list[Tensor]  # per layer: [H_kv, kept] logical positions left in the cache, ascending
    trace: list[EvictionEvent] = field(default_factory=list)
    prompt_len: int = 0
    steps: int = 0  # forward passes run

    @property
    def kept_counts(self) -> list[int]:
        return [int(p.shape[-1]) for p in self.kept_positions]


class _Run:
    """One request's paged cache and step state; the attention hook reads it through a context var."""

    def __init__(self, model: Any, policy: Policy | None, config: EvictionConfig | None, prompt_len: int,
                 max_tokens: int, slack: int, kv_cache_dtype: str = "auto", kv_scale: float = 1.0) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.query_heads = cfg.num_attention_heads
        self.head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.policy, self.config, self.prompt_len, self.slack = policy, config, prompt_len, slack
        pages = -(-max_tokens // PAGE_SIZE)
        shape = (pages + 1, self.kv_heads, PAGE_SIZE, self.head_size)  # page 0: trash (vLLM's null page)
        check_kv_cache_dtype(kv_cache_dtype)
        fp8 = fp8_storage_dtype(kv_cache_dtype)  # an fp8 cache as vLLM keeps it: fp8(k / scale), per layer
        stored = fp8 if fp8 is not None else self.dtype
        self.k = [torch.zeros(shape, dtype=stored, device=self.device) for _ in range(self.layers)]
        self.v = [torch.zeros(shape, dtype=stored, device=self.device) for _ in range(self.layers)]
        kv_scale_t = torch.tensor(float(kv_scale), device=self.device) if fp8 is not None else None
        self.block_table = torch.arange(1, pages + 1, device=self.device).view(1, -1)
        self.positions = torch.zeros(self.layers, *shape[:3], dtype=POSITION_DTYPE, device=self.device)
        self.states = {name: torch.zeros(self.layers, *shape[:3], device=self.device)
                       for name in (policy.state_names if policy else ())}
        group = self.query_heads // self.kv_heads
        for name in (policy.head_state_names if policy else ()):
            self.states[name] = torch.zeros(self.layers, *shape[:3], group, device=self.device)
        # Elastic mode keeps the window's queries (it can be compressed at any step); fixed mode accumulates
        # the window's mass as the engine does (vllm_evict.schedule.window_end).
        elastic = config is not None and config.elastic
        window = policy.window_for(config.budget) if policy and elastic else 0
        self.window = window
        self.window_count = 0
        self.ring_positions = torch.full((2, window), -1, dtype=torch.int64, device=self.device) if window else None
        self.caches = [
            LayerCache(index=i, k=self.k[i], v=self.v[i], positions=self.positions[i],
                       state={n: b[i] for n, b in self.states.items()},
                       ring=torch.zeros(2, window, self.query_heads, self.head_size, dtype=self.dtype,
                                        device=self.device) if window else None,
                       scale=1.0, k_scale=kv_scale_t, v_scale=kv_scale_t)
            for i in range(self.layers)]
        self.initializers, self.zero_states = state_initializers([policy] if policy else [])
        self.trace: list[EvictionEvent] = []
        self.step = 0
        self.tokens_before = 0  # logical tokens before this step
        self.cached = 0  # physical tokens before this step
        self.num_new = 0
        self.keep: int | None = None
        self.phase = Phase.PREFILL
        self.plan: StepPlan | None = None

    def begin_step(self, num_new: int) -> None:
        """The step's plan: one row, its new slots, and a group when it evicts (or updates every step)."""
        self.num_new = num_new
        slots = torch.arange(self.cached, self.cached + num_new, device=self.device)
        positions = torch.arange(self.tokens_before, self.tokens_before + num_new, device=self.device)
        pages = self.block_table[0, slots // PAGE_SIZE]
        ring_index = None
        if self.window:
            entries, tokens = ring_entries(np.zeros(num_new, dtype=np.int64), np.zeros(1, dtype=np.int64),
                                           np.arange(num_new), np.array([num_new]), np.array([self.tokens_before]),
                                           self.window)
            ring_index = torch.from_numpy(entries).to(self.device)
            ring_tokens = torch.from_numpy(tokens).to(self.device) if tokens is not None else None
        record = Record(pages=pages, offsets=slots % PAGE_SIZE, positions=positions.to(POSITION_DTYPE),
                        ring_index=ring_index, ring_tokens=ring_tokens if self.window else None)
        self.plan = StepPlan(record=record, groups=[], ring_positions=self.ring_positions,
                             zero_states=self.zero_states)
        self.keep = None
        if self.policy is None:
            return
        record_step(self.positions, self.states, self.plan)
        self.phase = phase_of(self.tokens_before, num_new, self.prompt_len)
        cached_after = self.cached + num_new
        self.keep = None if self.config.elastic else eviction_target(  # elastic: only when compressed
            phys_after=cached_after, phase=self.phase, budget=self.config.budget, schedule=self.config.schedule,
            slack=self.slack)
        one = lambda value: np.array([value], dtype=np.int64)  # noqa: E731
        window = self._window_step(cached_after, num_new)
        if self.keep is None and not self.policy.needs_every_step and (window is None or not (
                window.recorded.any() or window.reset)):
            return
        pages_used = -(-cached_after // PAGE_SIZE)
        self.plan.groups.append(build_group(
            self.policy, self.phase, self.block_table[:, :pages_used], PAGE_SIZE, lengths=one(cached_after),
            computed=one(self.tokens_before), scheduled=one(num_new), seed=one(self.config.seed),
            keep=one(self.keep) if self.keep is not None else None,
            ring_rows=one(0) if self.window else None, token_starts=one(0), window=window))

    def _window_step(self, cached_after: int, num_new: int) -> WindowStep | None:
        """The step's part of the accumulated observation window (fixed mode), as the engine's step builder."""
        if not self.policy.accumulates_window or self.config.elastic:
            return None
        one = lambda value: np.array([value])  # noqa: E731
        end = window_end(cached_after=one(cached_after), scheduled=one(num_new),
                         logical_after=one(self.tokens_before + num_new), prompt=one(self.prompt_len),
                         evicting=one(self.keep is not None), budget=one(self.config.budget), slack=one(self.slack),
                         one_shot=one(self.config.schedule == "oneshot"),
                         at_prompt_end=one(self.policy.window_at_prompt_end),
                         in_decode=one(self.policy.window_in_decode))
        recorded = end.recorded(one(cached_after), one(num_new), self.policy.window_size(end.logical, end.kept))
        count = self.window_count + recorded
        self.window_count = 0 if end.now[0] else int(count[0])
        return WindowStep(recorded=recorded, count=count, gain=self.policy.window_gain(end.logical, end.kept, self.head_size),
                          reset=bool(end.now[0]))

    def compress(self, keep: int) -> None:
        """Elastic mode's compression before a step: the cache as the last step left it, scored with the
        latest queries of the window, cut to ``keep`` tokens (engine/step_builder.compress_before_forward)."""
        if self.policy is None or keep >= self.cached:
            return
        one = lambda value: np.array([value], dtype=np.int64)  # noqa: E731
        phase = Phase.DECODE if self.tokens_before >= self.prompt_len else Phase.PREFILL
        group = build_group(
            self.policy, phase, self.block_table[:, :-(-self.cached // PAGE_SIZE)], PAGE_SIZE,
            lengths=one(self.cached), computed=one(self.tokens_before), scheduled=one(0), seed=one(self.config.seed),
            keep=one(keep), ring_rows=one(0) if self.window else None, token_starts=one(0))
        nothing = torch.zeros(0, dtype=torch.int64, device=self.device)
        plan = StepPlan(record=Record(pages=nothing, offsets=nothing, positions=nothing.to(POSITION_DTYPE),
                                      ring_index=None), groups=[group], ring_positions=self.ring_positions)
        no_queries = torch.zeros(0, self.query_heads, self.head_size, dtype=self.dtype, device=self.device)
        for cache in self.caches:
            evict_layer(cache, plan, no_queries)
            self.trace.append(EvictionEvent(step=self.step, layer=cache.index, phase=phase,
                                            seq_len=self.tokens_before, phys_before=self.cached, kept=keep))
        self.cached = keep

    def end_step(self) -> None:
        self.tokens_before += self.num_new
        self.cached = self.keep if self.keep is not None else self.cached + self.num_new
        self.step += 1

    def kept_positions(self) -> list[Tensor]:
        return [torch.sort(gather_tokens(self.positions[i], self.block_table, self.cached)[0].long(), dim=-1).values.cpu()
                for i in range(self.layers)]


_ACTIVE: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("vllm_evict_reference_run", default=None)


def _positional_attention(query: Tensor, key: Tensor, value: Tensor, key_positions: Tensor,
                          query_positions: Tensor, scale: float) -> Tensor:
    """fp32 attention of [H_q, m, d] queries over [H_kv, n, d] keys with a logical-position causal mask.

    Returns [H_q, m, d] (fp32).
    """
    h_q, m, d = query.shape
    h_kv, n, _ = key.shape
    group = h_q // h_kv
    q = query.float().view(h_kv, group, m, d)
    logits = torch.einsum("hgmd,hnd->hgmn", q, key.float()) * scale
    visible = key_positions.view(h_kv, 1, 1, n) <= query_positions.view(1, 1, m, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("hgmn,hnd->hgmd", probs, value.float())
    return out.reshape(h_q, m, d)


def _reference_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[Tensor, None]:
    run = _ACTIVE.get()
    if run is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION!r} attention only runs inside vllm_evict.reference.run_reference")
    if query.shape[0] != 1:
        raise ValueError("the reference runner supports batch size 1 only")
    index = int(module.layer_idx)
    cache = run.caches[index]
    cache.scale = float(scaling if scaling is not None else module.scaling)
    q, k_new, v_new = query[0], key[0], value[0]  # [H_q, m, d], [H_kv, m, d] post-RoPE
    m = q.shape[1]
    rec = run.plan.record
    for target, new, kv_scale in ((cache.k, k_new, cache.k_scale), (cache.v, v_new, cache.v_scale)):
        stored = new.transpose(0, 1) if kv_scale is None else (new.transpose(0, 1).float() / kv_scale)
        as_bytes(target)[rec.pages, :, rec.offsets] = as_bytes(stored.to(target.dtype))
    n = run.cached + m
    keys = dequantized_tokens(cache.k, run.block_table, n, cache.k_scale)[0]  # what the attention reads
    values = dequantized_tokens(cache.v, run.block_table, n, cache.v_scale)[0]
    if run.policy is None:
        key_positions = torch.arange(n, device=q.device).expand(keys.shape[0], n)  # no eviction: slot = position
    else:
        key_positions = gather_tokens(cache.positions, run.block_table, n)[0].long()
    out = _positional_attention(q, keys, values, key_positions, rec.positions.long(), cache.scale)
    attn_output = out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, m, H_q, d]
    if run.policy is None:
        return attn_output, None
    if run.policy.needs_o_proj and cache.o_proj is None:
        cache.o_proj = module.o_proj.weight
    step_query = q.transpose(0, 1)  # [m, H_q, d]
    record_layer(cache, run.plan, run.initializers, step_query.contiguous(), k_new.transpose(0, 1).contiguous(),
                 v_new.transpose(0, 1).contiguous())
    if run.plan.groups:
        evict_layer(cache, run.plan, step_query)
        if run.keep is not None:
            run.trace.append(EvictionEvent(step=run.step, layer=index, phase=run.phase,
                                           seq_len=run.tokens_before + m, phys_before=n, kept=run.keep))
    return attn_output, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _reference_attention)


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a causal LM (and its tokenizer) from a local HF folder for the reference runner."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _eos_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids


@torch.inference_mode()
def run_reference(model_or_path: Any, prompt_ids: Sequence[int], config: EvictionConfig | None,
                  max_new_tokens: int, chunk_size: int | Sequence[int] = 128, page_size: int = 1, *, tokenizer: Any = None,
                  ignore_eos: bool = False, compressions: Mapping[int, Sequence[int]] | None = None,
                  kv_cache_dtype: str = "auto", kv_scale: float = 1.0) -> ReferenceResult:
    """Greedy generation with the engine's eviction mechanics (see the module docstring).

    ``page_size`` is the engine's page size, from which ``config.slack_for`` derives the decode slack (the
    engine's rule; an explicit ``slack`` in the config wins). ``config=None`` runs plain generation through
    the same attention path.
    With ``ignore_eos=False`` generation stops after an EOS token (which is returned).
    ``compressions`` replays elastic mode: {step index: [tokens kept, ...]} compresses the cache before
    that forward step, once per entry, in order (the engine's ``EvictionPlan.compress``).
    ``kv_cache_dtype`` "fp8" / "fp8_e4m3" / "fp8_e5m2" keeps K and V as vLLM's fp8 cache does (fp8(k /
    kv_scale), one scale per layer for K and V; vLLM's default scale is 1.0): the attention and every score
    read them dequantised.
    """
    _register()
    if isinstance(model_or_path, (str, os.PathLike, Path)):
        model, loaded_tok = load_model(model_or_path)
        tokenizer = tokenizer if tokenizer is not None else loaded_tok
    else:
        model = model_or_path
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    sizes = _chunk_sizes(len(prompt), chunk_size)
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    policy = config.build_policy() if config is not None else None
    effective_slack = config.slack_for(page_size) if config is not None else page_size
    run = _Run(model, policy, config, len(prompt), len(prompt) + max_new_tokens, effective_slack, kv_cache_dtype,
               kv_scale)
    device = run.device
    eos = set() if ignore_eos else _eos_ids(model)

    previous_impl = model.config._attn_implementation
    if previous_impl != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    token = _ACTIVE.set(run)
    generated: list[int] = []
    logprobs: list[float] = []
    try:
        # Prompt chunks, then one token per step: the engine's schedule.
        starts = np.cumsum([0, *sizes])
        pending = [prompt[a:b] for a, b in zip(starts[:-1], starts[1:])]
        while max_new_tokens > 0:
            step_tokens = pending.pop(0) if pending else [generated[-1]]
            m = len(step_tokens)
            for keep in (compressions or {}).get(run.step, ()):
                run.compress(keep)
            run.begin_step(m)
            positions = torch.arange(run.tokens_before, run.tokens_before + m, device=device)
            out = model(input_ids=torch.tensor([step_tokens], device=device), position_ids=positions.view(1, m),
                        use_cache=False, logits_to_keep=1)
            run.end_step()
            if pending:
                continue
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            next_id = int(torch.argmax(logp))
            generated.append(next_id)
            logprobs.append(float(logp[next_id]))
            if len(generated) >= max_new_tokens or next_id in eos:
                break
    finally:
        _ACTIVE.reset(token)
        if previous_impl != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(previous_impl)

    kept = run.kept_positions() if policy is not None else [
        torch.arange(run.cached).expand(run.kv_heads, run.cached).clone() for _ in range(run.layers)]
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
    return ReferenceResult(token_ids=generated, logprobs=logprobs, text=text, kept_positions=kept,
                           trace=run.trace, prompt_len=len(prompt), steps=run.step)


def _chunk_sizes(prompt_len: int, chunk_size: int | Sequence[int]) -> list[int]:
    """The prompt's chunk sizes: equal chunks of ``chunk_size``, or an explicit list that covers the prompt."""
    if isinstance(chunk_size, int):
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        return [min(chunk_size, prompt_len - i) for i in range(0, prompt_len, chunk_size)]
    sizes = [int(c) for c in chunk_size]
    if any(c < 1 for c in sizes) or sum(sizes) != prompt_len:
        raise ValueError(f"chunk sizes {sizes} must be positive and add up to the prompt's {prompt_len} tokens")
    return sizes


def prompt_token_ids(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text`` (raw, or wrapped in the model's chat template with a generation prompt)."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(text)["input_ids"]]


__all__ = ["ATTN_IMPLEMENTATION", "EvictionEvent", "ReferenceResult", "load_model", "prompt_token_ids",
           "run_reference"]
