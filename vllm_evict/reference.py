"""The HF reference runner: greedy generation with per-head KV eviction in plain transformers.

This is the oracle the vLLM integration must agree with. It reproduces the engine's mechanics step
by step, for batch size 1:

* the prompt is fed in chunks of ``chunk_size`` tokens, then one generated token per step;
* RoPE positions stay LOGICAL (``position_ids`` = logical positions) while the cache is physically
  shorter; the runner tracks the logical position of every cached slot per (layer, KV head);
* in every layer, the attention over (cache + this step's tokens) is computed in fp32 with a causal
  mask built from logical positions (HF's own mask is not used);
* right after that layer's attention, the layer's policy step runs on the cache in slot order
  (this step's tokens included); the number of survivors comes only from
  :func:`vllm_evict.schedule.eviction_target`; the survivors of K, V, positions and every per-token
  state tensor are gathered per head with :func:`vllm_evict.policies.base.compact`.

The hook is an attention function registered with transformers' ``AttentionInterface`` under the
name :data:`ATTN_IMPLEMENTATION`; it receives the post-RoPE queries and the already-updated
``DynamicCache`` layer tensors, and replaces the layer's ``keys``/``values`` after eviction.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from vllm_evict.config import EvictionConfig
from vllm_evict.policies.base import EvictionInputs, Phase, Policy, compact
from vllm_evict.schedule import eviction_target, phase_of

ATTN_IMPLEMENTATION = "vllm_evict_reference"


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


@dataclass
class _LayerState:
    positions: Tensor  # [H_kv, n] int64, slot order
    state: dict[str, Tensor]  # name -> [H_kv, n] fp32
    queries: Tensor | None = None  # [H_q, w, d] ring buffer of post-RoPE queries, oldest first
    query_positions: Tensor | None = None  # [w]


class _Run:
    """Everything one request's steps share; the attention hook reads it through a context var."""

    def __init__(self, policy: Policy | None, config: EvictionConfig | None, prompt_len: int, slack: int):
        self.policy = policy
        self.config = config
        self.prompt_len = prompt_len
        self.slack = slack
        self.layers: dict[int, _LayerState] = {}
        self.trace: list[EvictionEvent] = []
        self.step = 0
        self.tokens_before = 0
        self.new_positions: Tensor | None = None  # [m] logical positions of this step's tokens
        self.cache: Any = None


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
    layer_idx = int(module.layer_idx)
    scale = float(scaling if scaling is not None else module.scaling)
    q = query[0]  # [H_q, m, d], post-RoPE
    k_all, v_all = key[0], value[0]  # [H_kv, n, d]: the cache with this step's tokens appended
    h_kv, n = k_all.shape[0], k_all.shape[1]
    m = q.shape[1]
    new_pos = run.new_positions
    layer = run.layers.get(layer_idx)
    if layer is None:
        layer = _LayerState(positions=torch.empty(h_kv, 0, dtype=torch.long, device=k_all.device), state={})
        run.layers[layer_idx] = layer
    positions = torch.cat([layer.positions, new_pos.view(1, m).expand(h_kv, m)], dim=1)
    if positions.shape[1] != n:
        raise RuntimeError(f"layer {layer_idx}: cache holds {n} slots but {positions.shape[1]} positions are tracked")

    out = _positional_attention(q, k_all, v_all, positions, new_pos, scale)
    attn_output = out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous()  # [1, m, H_q, d]

    policy = run.policy
    if policy is None:
        layer.positions = positions
        return attn_output, None

    # ---- per-token state of the new tokens, then the step's candidates -------------------------------
    o_proj = module.o_proj.weight if hasattr(module, "o_proj") else None
    new_state = policy.init_state(k_all[:, n - m:], v_all[:, n - m:], o_proj) if policy.state_names else {}
    state = {name: torch.cat([layer.state[name], new_state[name].float()], dim=1) if name in layer.state
             else new_state[name].float() for name in new_state}

    # ---- observation-window queries (ring buffer across steps) ---------------------------------------
    window = policy.query_window
    if window is None:
        queries, query_positions = q, new_pos
    elif window == 0:
        queries = q.new_empty(q.shape[0], 0, q.shape[2])
        query_positions = new_pos.new_empty(0)
    else:
        if layer.queries is None:
            queries, query_positions = q, new_pos
        else:
            queries = torch.cat([layer.queries, q], dim=1)
            query_positions = torch.cat([layer.query_positions, new_pos])
        queries, query_positions = queries[:, -window:], query_positions[-window:]
        layer.queries, layer.query_positions = queries, query_positions

    seq_len = run.tokens_before + m
    phase = phase_of(run.tokens_before, m, run.prompt_len)
    target = eviction_target(phys_after=n, phase=phase, budget=run.config.budget,
                             schedule=run.config.schedule, slack=run.slack)
    inp = EvictionInputs(
        keys=k_all, values=v_all, positions=positions, queries=queries, query_positions=query_positions,
        scale=scale, seq_len=seq_len, num_new=m, phase=phase, state=state, layer=layer_idx,
        seed=run.config.seed, o_proj=o_proj)
    result = policy.step(inp, target)
    new_state_all = result.state if result.state is not None else state
    if result.keep is None:
        layer.positions, layer.state = positions, dict(new_state_all)
        return attn_output, None

    keep = result.keep.to(device=k_all.device, dtype=torch.long)
    if keep.shape[0] != h_kv:
        raise RuntimeError(f"{policy.name} returned keep for {keep.shape[0]} heads, the layer has {h_kv}")
    cache_layer = run.cache.layers[layer_idx]
    cache_layer.keys = compact(k_all, keep).unsqueeze(0).contiguous()
    cache_layer.values = compact(v_all, keep).unsqueeze(0).contiguous()
    layer.positions = compact(positions, keep)
    layer.state = {name: compact(t, keep) for name, t in new_state_all.items()}
    run.trace.append(EvictionEvent(step=run.step, layer=layer_idx, phase=phase, seq_len=seq_len,
                                   phys_before=n, kept=int(keep.shape[1])))
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
                  max_new_tokens: int, chunk_size: int = 128, slack: int = 1, *, tokenizer: Any = None,
                  ignore_eos: bool = False) -> ReferenceResult:
    """Greedy generation with the engine's eviction mechanics (see the module docstring).

    ``slack`` is the decode slack used when ``config.slack`` is None (the engine's page size plays that
    role there). ``config=None`` runs plain generation through the same attention path.
    With ``ignore_eos=False`` generation stops after an EOS token (which is returned).
    """
    from transformers import DynamicCache

    _register()
    if isinstance(model_or_path, (str, os.PathLike, Path)):
        model, loaded_tok = load_model(model_or_path)
        tokenizer = tokenizer if tokenizer is not None else loaded_tok
    else:
        model = model_or_path
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if chunk_size < 1 or max_new_tokens < 0:
        raise ValueError("chunk_size must be >= 1 and max_new_tokens >= 0")
    policy = config.build_policy() if config is not None else None
    effective_slack = config.slack if config is not None and config.slack is not None else slack
    run = _Run(policy, config, len(prompt), effective_slack)
    device = next(model.parameters()).device
    run.cache = DynamicCache(config=model.config)
    eos = set() if ignore_eos else _eos_ids(model)

    previous_impl = model.config._attn_implementation
    if previous_impl != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    token = _ACTIVE.set(run)
    generated: list[int] = []
    logprobs: list[float] = []
    try:
        # Prompt chunks, then one token per step: the engine's schedule.
        pending = [prompt[i:i + chunk_size] for i in range(0, len(prompt), chunk_size)]
        while max_new_tokens > 0:
            step_tokens = pending.pop(0) if pending else [generated[-1]]
            m = len(step_tokens)
            run.new_positions = torch.arange(run.tokens_before, run.tokens_before + m, device=device)
            out = model(input_ids=torch.tensor([step_tokens], device=device),
                        position_ids=run.new_positions.view(1, m), past_key_values=run.cache, use_cache=True,
                        logits_to_keep=1)
            run.tokens_before += m
            run.step += 1
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

    kept = []
    for i in range(model.config.num_hidden_layers):
        layer = run.layers.get(i)
        kept.append(torch.sort(layer.positions, dim=-1).values.cpu() if layer is not None
                    else torch.empty(0, 0, dtype=torch.long))
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
    return ReferenceResult(token_ids=generated, logprobs=logprobs, text=text, kept_positions=kept,
                           trace=run.trace, prompt_len=len(prompt), steps=run.step)


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
