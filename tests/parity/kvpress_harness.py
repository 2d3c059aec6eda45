"""Run NVIDIA kvpress's presses and our policies on the same forward pass, and read back what each kept.

How kvpress is driven (nothing of its code is copied here):

* The model is ours (``vllm_evict.reference.load_model``, float32) and the forward pass is the HF reference
  runner with no eviction, the whole prompt in one chunk, one token generated. Our policies run in the same
  runner, so both sides see the same hidden states, keys and values bit for bit.
* A forward hook on every attention module calls each press's own ``compress`` on the layer's full
  cache with the arguments kvpress's own forward hook passes it (module, hidden states, keys, values,
  attention weights, the module's keyword arguments). ``compress`` scores, takes its top-k and returns the
  pruned keys; they are not written back, so every press sees the full cache and one forward serves all.
  ``kept_through_press_hooks`` runs one press the ordinary way (``with press(model)``) to show that this
  shortcut keeps the same tokens.
* Each pruned key is matched bit for bit to the cached key it was gathered from: that gives the logical
  positions a press kept, per (layer, KV head).
* Each press's ``score`` output is recorded on the way (its method wrapped on the instance), for the tie
  analysis of ``disagreements_outside_ties``.

Budget: kvpress keeps ``int(n * (1 - compression_ratio))`` tokens per head (``kvpress.utils.compute_n_kept``);
``compression_ratio = 1 - (budget + 0.5) / n`` makes that exactly ``budget``, and CriticalKV's stage-1
count ``int((1 - ratio) * n * first_stage_ratio)`` exactly ``floor(first_stage_ratio * budget)``, ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from vllm_evict import EvictionConfig
from vllm_evict.reference import run_reference

try:
    from kvpress.presses.criticalkv_press import CriticalKVPress
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept
except ImportError as exc:  # a clear message, not a skip: the comparison is part of the suite
    raise ImportError("the parity tests need NVIDIA kvpress: run `make install`, which installs kvpress==0.5.5 "
                      "with --no-deps plus datasets and fire (imported by `import kvpress`)") from exc


@dataclass
class PressRun:
    """What one press kept on one prompt."""

    kept: dict[int, Tensor] = field(default_factory=dict)  # layer -> [H_kv, budget] positions, ascending
    scores: dict[int, Tensor] = field(default_factory=dict)  # layer -> [H_kv, n] its score() output, fp32


def compression_ratio_for(budget: int, n: int, first_stage_ratio: float | None = None) -> float:
    """The kvpress ``compression_ratio`` that keeps exactly ``budget`` of ``n`` tokens per head."""
    if not 0 < budget < n:
        raise ValueError(f"budget must be in 1..{n - 1} for a {n}-token prompt, got {budget}")
    ratio = 1.0 - (budget + 0.5) / n
    if compute_n_kept(n, ratio) != budget:
        raise AssertionError(f"kvpress would keep {compute_n_kept(n, ratio)} tokens, not {budget}")
    if first_stage_ratio is not None and int((1 - ratio) * n * first_stage_ratio) != math.floor(first_stage_ratio * budget):
        raise AssertionError("kvpress's CriticalKV stage-1 count would differ from floor(alpha * budget)")
    return ratio


def positions_of(kept_keys: Tensor, cached_keys: Tensor) -> Tensor:
    """[H, b, d] keys a press kept and the [H, n, d] cache it pruned -> [H, b] positions, ascending.

    The runner holds the prompt in position order, so a slot index is a logical position. Every kept key
    must equal exactly one cached key bit for bit (RoPE makes the keys of equal tokens differ)."""
    same = (kept_keys[:, :, None, :] == cached_keys[:, None, :, :]).all(dim=-1)  # [H, b, n]
    matches = same.sum(dim=-1)
    if not bool((matches == 1).all()):
        raise AssertionError(f"kept keys matching 0 or several cached keys: {matches.unique().tolist()}")
    return torch.sort(same.to(torch.int8).argmax(dim=-1), dim=-1).values


def _record_scores(press: Any, run: PressRun) -> None:
    """Wrap the press's ``score`` on the instance so that every call's output is kept in ``run``."""
    original = press.score

    def score(module: Any, *args: Any, **kwargs: Any) -> Tensor:
        out = original(module, *args, **kwargs)
        run.scores[int(module.layer_idx)] = out[0].detach().float().clone()
        return out

    press.score = score


def _attention_modules(model: Any) -> list[Any]:
    return [layer.self_attn for layer in model.model.layers]


def _prefill(model: Any, prompt_ids: Sequence[int]) -> None:
    """One plain transformers forward of the whole prompt into a DynamicCache (eager attention, fp32):
    what kvpress's presses are written for. The cache's keys are the same post-RoPE keys our runner caches."""
    from transformers import DynamicCache

    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(prompt_ids)]), past_key_values=DynamicCache(config=model.config),
                  use_cache=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)


def run_presses(model: Any, prompt_ids: Sequence[int], budget: int,
                presses: Mapping[str, Callable[[], ScorerPress]]) -> dict[str, PressRun]:
    """name -> what the press built by ``presses[name]()`` keeps at ``budget`` on this prompt (one forward)."""
    n = len(prompt_ids)
    built: dict[str, ScorerPress] = {}
    runs: dict[str, PressRun] = {}
    for name, make in presses.items():
        press = make()
        stage1 = press.first_stage_ratio if isinstance(press, CriticalKVPress) else None
        press.compression_ratio = compression_ratio_for(budget, n, stage1)
        press.post_init_from_model(model)
        built[name], runs[name] = press, PressRun()
        _record_scores(press, runs[name])

    def after_attention(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        layer = int(module.layer_idx)
        cache = kwargs["past_key_values"].layers[layer]
        keys, values = cache.keys, cache.values  # [1, H_kv, n, d], the whole prompt
        for name, press in built.items():
            kept_keys, _ = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            runs[name].kept[layer] = positions_of(kept_keys[0], keys[0])

    hooks = [m.register_forward_hook(after_attention, with_kwargs=True) for m in _attention_modules(model)]
    try:
        _prefill(model, prompt_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return runs


def kept_through_press_hooks(model: Any, prompt_ids: Sequence[int], budget: int, press: ScorerPress) -> dict[int, Tensor]:
    """layer -> [H_kv, budget] positions the press keeps when it runs through its own forward hooks."""
    n = len(prompt_ids)
    press.compression_ratio = compression_ratio_for(budget, n)
    full: dict[int, Tensor] = {}
    pruned: dict[int, Tensor] = {}

    def cache_position(module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        # transformers 5 no longer passes cache_position to attention modules; kvpress 0.5.5 reads it
        # to tell the prefill from decoding. For an unpadded prompt it is the position ids.
        kwargs.setdefault("cache_position", kwargs["position_ids"][0])
        return args, kwargs

    def observer(into: dict[int, Tensor]) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            into[int(module.layer_idx)] = kwargs["past_key_values"].layers[module.layer_idx].keys[0].clone()
        return hook

    modules = _attention_modules(model)
    # Forward hooks run in the order they were registered: `full` before the press's hook, `pruned` after.
    hooks = [m.register_forward_pre_hook(cache_position, with_kwargs=True) for m in modules]
    hooks += [m.register_forward_hook(observer(full), with_kwargs=True) for m in modules]
    try:
        with press(model):
            hooks += [m.register_forward_hook(observer(pruned), with_kwargs=True) for m in modules]
            _prefill(model, prompt_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: positions_of(pruned[layer], full[layer]) for layer in full}


def our_kept(model: Any, prompt_ids: Sequence[int], spec: str, budget: int, options: Mapping[str, Any]) -> list[Tensor]:
    """Per layer [H_kv, budget]: what our policy keeps, one-shot after the whole prompt in one chunk."""
    config = EvictionConfig.from_spec(spec, budget, schedule="oneshot", **options)
    result = run_reference(model, prompt_ids, config, max_new_tokens=1, chunk_size=len(prompt_ids))
    if result.kept_counts != [budget] * len(result.kept_positions):
        raise AssertionError(f"{spec} did not evict to {budget}: kept {result.kept_counts}")
    return result.kept_positions


def cutoff(scores: Tensor, budget: int) -> float:
    """The ``budget``-th largest score: the boundary of a top-``budget`` selection."""
    return float(torch.sort(scores.float(), descending=True).values[budget - 1])


def disagreements_outside_ties(ours: Tensor, reference: Tensor, reference_scores: Tensor, rtol: float) -> list[int]:
    """Positions kept by exactly one side that are NOT explained by a float tie at the reference's cut-off.

    "Within ties" means: both sides keep ``budget`` tokens, and every position kept by one side only has a
    reference score within ``rtol * max|score|`` of the reference's cut-off (the ``budget``-th largest
    score). Such a swap is a choice between tokens whose scores are equal up to rounding; anything else
    is returned. ``ours`` and ``reference``: [budget] positions; ``reference_scores``: [n].
    """
    if ours.numel() != reference.numel():
        raise AssertionError(f"ours keeps {ours.numel()} tokens, the reference {reference.numel()}")
    scores = reference_scores.float()
    edge = cutoff(scores, reference.numel())
    tolerance = rtol * float(scores.abs().max())
    only_one = set(ours.tolist()) ^ set(reference.tolist())
    return sorted(j for j in only_one if abs(float(scores[j]) - edge) > tolerance)
