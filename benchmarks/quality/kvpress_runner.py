"""The same samples through NVIDIA kvpress: HF transformers, kvpress's own presses, greedy decoding.

How kvpress runs here (nothing of its code is copied): the model is a plain transformers
``AutoModelForCausalLM`` with eager attention (the observed-attention press reads the attention
weights). One prefill forward of the compressed span serves every (press, ratio): a forward hook on each
attention module calls each press's own ``compress`` on the layer's full cache with the arguments
kvpress's hook passes it, and keeps the pruned keys and values; the forward itself goes on with the full
cache, exactly as under kvpress's hook, whose compression also happens after the layer's attention has
run (tests/parity shows that this shortcut keeps the same tokens as ``with press(model)``). Then, for
each (press, ratio), a cache of the pruned keys and values is built and decoded greedily, as kvpress's
pipeline does:

* query-aware: the span is the whole prompt; the first answer token comes from the prefill's logits;
* query-agnostic: the span is the context; the question part is then run through the model on top of
  the compressed cache (uncompressed), and the answer follows.

Positions stay logical (the pruned cache is shorter; position ids continue after the span), and decoding
stops at an end-of-sequence token or after the task's ``max_new_tokens``. kvpress keeps
``int(span * (1 - ratio))`` tokens per head (``kvpress.utils.compute_n_kept``), the same budget the
engine runner asks for; the realised ratio is what the press kept.

kvpress's own ``--query_aware`` evaluation leaves the chat template's tail and the answer prefix out of
the compressed span; here both backends compress the whole prompt (what a chat request is to an engine),
so the two sides compare the same thing.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from benchmarks.quality.methods import Press, kept_tokens
from benchmarks.quality.prompts import Prompt
from benchmarks.quality.scoring import string_match_all


def load(model_path: str, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager")
    model.eval()
    if getattr(model.config, "head_dim", None) is None:
        # kvpress's CriticalKVPress reads config.head_dim, which Qwen2's config leaves out (it derives it).
        model.config.head_dim = model.config.hidden_size // model.config.num_attention_heads
    return model, AutoTokenizer.from_pretrained(model_path)


def _attention_modules(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _cache_from(model: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


@torch.inference_mode()
def prefill(model: Any, span_ids: Sequence[int], jobs: dict[tuple[str, float], Any]) -> tuple[torch.Tensor, Any, dict]:
    """One forward of ``span_ids``; every press in ``jobs`` ((name, ratio) -> press, ratio already set)
    compresses each layer's full cache from a hook. Returns the last position's logits, the full cache
    and (name, ratio) -> per-layer pruned (keys, values)."""
    from transformers import DynamicCache

    pruned: dict[tuple[str, float], list[Any]] = {job: [None] * model.config.num_hidden_layers for job in jobs}

    def after_attention(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        layer = int(module.layer_idx)
        cache = kwargs["past_key_values"].layers[layer]
        for job, press in jobs.items():
            pruned[job][layer] = press.compress(module, kwargs["hidden_states"], cache.keys, cache.values,
                                                output[1], kwargs)

    hooks = [m.register_forward_hook(after_attention, with_kwargs=True) for m in _attention_modules(model)]
    cache = DynamicCache(config=model.config)
    try:
        out = model(input_ids=torch.tensor([list(span_ids)]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    full = [(layer.keys, layer.values) for layer in cache.layers]
    return out.logits[0, -1].float(), full, pruned


@torch.inference_mode()
def decode(model: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], span: int, logits: torch.Tensor,
           question: Sequence[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy answer on a cache of ``layers`` (the span's kept keys/values): feed ``question`` first (if
    any), then decode. Positions continue from ``span``."""
    cache = _cache_from(model, layers)
    position = span
    if question:
        ids = torch.tensor([list(question)])
        positions = torch.arange(position, position + len(question)).unsqueeze(0)
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits[0, -1]
        position += len(question)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                    position_ids=torch.tensor([[position]]), logits_to_keep=1)
        logits, position = out.logits[0, -1], position + 1
    return tokens


def run(model: Any, tokenizer: Any, prompt: Prompt, setting: str, presses: dict[str, Press], ratios: Sequence[float],
        eos: set[int], full: bool, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (press, ratio) of one sample and setting, plus the full cache if ``full``: result records."""
    sample = prompt.sample
    agnostic = setting == "agnostic"
    span_ids = list(prompt.context_ids) if agnostic else prompt.ids
    span = len(span_ids)
    question = list(prompt.question_ids) if agnostic else []
    jobs = {}
    for name, press in presses.items():
        for ratio in ratios:
            instance = press.make()
            instance.compression_ratio = ratio
            instance.post_init_from_model(model)
            jobs[(name, ratio)] = instance
    start = time.monotonic()
    logits, full_cache, pruned = prefill(model, span_ids, jobs)
    prefill_seconds = time.monotonic() - start
    runs: list[tuple[str, float, Any]] = [("full", 0.0, full_cache)] if full else []
    runs += [(name, ratio, pruned[(name, ratio)]) for (name, ratio) in jobs]
    records = []
    for name, ratio, layers in runs:
        start = time.monotonic()
        tokens = decode(model, layers, span, logits, question, sample.max_new_tokens, eos)
        kept = int(layers[0][0].shape[2])
        if any(int(k.shape[2]) != kept for k, _ in layers):
            raise AssertionError(f"{name} kept different counts in different layers")
        answer = tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)
        records.append({
            **base, "backend": "kvpress", "setting": setting, "length": sample.length, "task": sample.task,
            "index": sample.index, "method": name, "ratio": ratio,
            "twin": presses[name].twin if name in presses else "full",
            "budget": None if name == "full" else kept_tokens(span, ratio), "kept": kept, "span_tokens": span,
            "prompt_tokens": prompt.num_tokens, "question_tokens": len(prompt.question_ids),
            "expected": list(sample.answers), "answer": answer, "score": string_match_all(answer, sample.answers),
            "realised_ratio": (span - kept) / span, "error": None, "prefill_seconds": prefill_seconds,
            "decode_seconds": time.monotonic() - start})
    return records
