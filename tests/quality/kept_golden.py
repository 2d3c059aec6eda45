"""What each method keeps on fixed prompts, pinned: the quality regression test's expected values.

``tests/quality/kept_tokens.json`` holds, for every method a user picks from (the suite's ``defaults``
profile: the defaults and the kvpress twins), on two of the suite's prompts (SmolLM2-135M-Instruct, float32,
query-aware, ratio 0.75, prefill chunks of 256 tokens, one token generated), a short hash of the logical
positions each (layer, KV head) keeps. The HF reference runner (``vllm_evict.reference``) writes it;
tests/quality/test_kept_tokens.py checks the engine (and the reference) against it, so a change that alters
what a method keeps fails CI until the file is written again on purpose:

    .venv/bin/python -m tests.quality.kept_golden      # rewrites kept_tokens.json, prints what changed

Rounding differs between the engine and the reference (their keys differ by up to ~1e-4 relative on
SmolLM2 here) and between CPUs (AVX2 and AVX-512 builds of the same kernels), so a (layer, head) whose
choice hangs on a near-tie may flip. The file also records, per (layer, head), its smallest gap at a
cut-off: while the reference runs, every selection of the k best of a score (``dense.topk_keep``, NaCl's
``first_k_mask``, CriticalKV's two stages) gives the gap between the k-th and the (k+1)-th value, relative
to the head's largest |value|. A check allows a few heads to differ (``allowed``) if each of them had a
gap under NEAR_TIE; a change to a method moves many heads, and heads with wide gaps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from benchmarks.quality import engine_runner as E
from benchmarks.quality import methods as M
from benchmarks.quality import prompts as P

GOLDEN = Path(__file__).with_name("kept_tokens.json")
MODEL = "smollm2-135m-instruct"
RATIO = 0.75
CHUNK = 256  # the engine's max_num_batched_tokens (tests/quality/conftest.py): the prefill chunks
LENGTH = 384
PROMPTS = {"passkey": ("passkey", 0), "variable-tracking": ("vt", 0)}  # name -> (suite task, sample index)
METHODS = tuple(name for name in M.PROFILES["defaults"] if name != "full")
NEAR_TIE = 1e-3  # a head whose smallest relative gap is under this may flip by rounding
FLIPS = 0.05  # of a case's heads, at most this many (and at least one) may flip
# Key-norm ranks by the key's norm alone, and these prompts repeat sentences: most of its heads hold keys
# whose norms agree to 4-5 digits, and the engine flipped 6 of 90 of them on variable-tracking (AVX2).
FLIPS_FOR = {"knorm": 0.15}  # by policy spec (knorm:oneshot too)


@dataclass(frozen=True)
class Case:
    method: str
    prompt: str
    prompt_ids: list[int]
    extra_args: dict[str, Any]  # what the engine request carries (its method, budget and options)
    budget: int


def prompts(tokenizer: Any) -> dict[str, P.Prompt]:
    return {name: P.fit(tokenizer, task, LENGTH, index) for name, (task, index) in PROMPTS.items()}


def cases(tokenizer: Any) -> list[Case]:
    """Every (method, prompt), built as the suite builds its query-aware requests."""
    out = []
    for prompt_name, prompt in prompts(tokenizer).items():
        for method in METHODS:
            request = E.requests_for(prompt, "aware", M.ALL_METHODS[method], RATIO)
            out.append(Case(method, prompt_name, list(request.prompt_ids), dict(request.extra_args), int(request.budget)))
    return out


def config_of(case: Case) -> Any:
    """The eviction config the engine resolves for the case's request: the reference runs the same one."""
    from vllm_evict.request_settings import resolve_request_config

    return resolve_request_config(E.SERVER_EVICTION, case.extra_args)


def tokens_hash(ids: Sequence[int]) -> str:
    return hashlib.sha1(torch.tensor(list(ids), dtype=torch.int32).numpy().tobytes()).hexdigest()[:16]


def head_hash(positions: Tensor) -> str:
    """8 hex digits of the sorted kept positions of one (layer, KV head)."""
    data = torch.sort(positions.to(torch.int64)).values.to(torch.int32).numpy().tobytes()
    return hashlib.sha1(data).hexdigest()[:8]


def hashes(kept: Sequence[Tensor]) -> list[str]:
    """Per layer [H_kv, kept] positions -> one hash per (layer, head), layer-major."""
    return [head_hash(layer[h]) for layer in kept for h in range(layer.shape[0])]


def mismatches(expected: str, kept: Sequence[Tensor]) -> list[tuple[int, int]]:
    """(layer, head) pairs where ``kept`` differs from the pinned line."""
    pinned = expected.split()
    heads = kept[0].shape[0]
    got = hashes(kept)
    if len(got) != len(pinned):
        raise AssertionError(f"{len(got)} (layer, head) pairs, the pinned line has {len(pinned)}")
    return [(i // heads, i % heads) for i, (want, have) in enumerate(zip(pinned, got)) if want != have]


def unexplained(golden: dict[str, Any], name: str, kept: Sequence[Tensor]) -> str | None:
    """Why ``kept`` is not what the file pins for case ``name`` (None: it is, up to near-ties): more than
    ``allowed`` heads differ, or a head with a wide gap differs."""
    changed = mismatches(golden["kept"][name], kept)
    heads = kept[0].shape[0]
    gaps = [float(g) for g in golden["gaps"][name].split()]
    wide = [(layer, h) for layer, h in changed if gaps[layer * heads + h] >= NEAR_TIE]
    spec = M.ALL_METHODS[name.split(" @ ")[0]].spec
    allowed = max(1, int(FLIPS_FOR.get(spec, FLIPS) * len(gaps)))
    if wide or len(changed) > allowed:
        return (f"{name}: other tokens kept in {len(changed)} of {len(gaps)} (layer, head) pairs (at most "
                f"{allowed} near-ties may flip), {len(wide)} of them far from a tie: {(wide or changed)[:8]}")
    return None


def load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def key_for(method: str, prompt: str) -> str:
    return f"{method} @ {prompt}"


def key(case: Case) -> str:
    return key_for(case.method, case.prompt)


# ---- the writer ------------------------------------------------------------------------------------
def reference_kept(model: Any, case: Case) -> list[Tensor]:
    from vllm_evict.reference import run_reference

    result = run_reference(model, case.prompt_ids, config_of(case), max_new_tokens=1, chunk_size=CHUNK,
                           ignore_eos=True)
    return [layer.cpu() for layer in result.kept_positions]


class Gaps:
    """While active, the smallest relative gap at every cut-off of every selection, per (layer, head)."""

    def __init__(self, layers: int, heads: int) -> None:
        self.gap = torch.full((layers, heads), float("inf"), dtype=torch.float64)
        self.layer = -1

    def cut(self, values: Tensor, eligible: Tensor, count: Tensor) -> None:
        """values [R, H, N], eligible bool broadcastable to it, count [R] or [R, H]: the ``count`` best
        eligible values are taken (row 0: the reference runs one request)."""
        x = values[0].double().masked_fill(values[0].isnan(), float("-inf"))  # (nan_to_num would clip the infs)
        keep = eligible.expand_as(values)[0]
        counts = count[0].reshape(-1).expand(x.shape[0])  # one count for the row, or one per head
        for h in range(x.shape[0]):
            column = torch.sort(x[h][keep[h]], descending=True).values
            k = int(counts[h])
            if not 0 < k < column.numel():
                continue
            above, below = float(column[k - 1]), float(column[k])
            if above == float("inf") and below != float("inf"):
                continue  # the cut-off falls between protected tokens and the rest
            finite = column[torch.isfinite(column)]
            scale = float(finite.abs().max()) if finite.numel() else 1.0
            gap = (above - below) / scale if scale > 0 and math.isfinite(above - below) else 0.0
            self.gap[self.layer, h] = min(float(self.gap[self.layer, h]), gap)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        from vllm_evict import dense, reference
        from vllm_evict.policies import criticalkv, nacl

        evict_layer, topk_keep = reference.evict_layer, dense.topk_keep
        first_k_mask, two_stage_keep = nacl.first_k_mask, criticalkv.two_stage_keep

        def layer_hook(cache: Any, *args: Any) -> Any:
            self.layer = cache.index
            return evict_layer(cache, *args)

        def topk_hook(scores: Tensor, valid: Tensor, budget: Tensor, budget_max: int) -> Tensor:
            self.cut(scores.float().masked_fill(~valid, float("-inf")), valid, budget)
            return topk_keep(scores, valid, budget, budget_max)

        def first_k_hook(keys: Tensor, eligible: Tensor, counts: Tensor) -> Tensor:
            self.cut(keys.float(), eligible, counts)
            return first_k_mask(keys, eligible, counts)

        def two_stage_hook(s1: Tensor, nu: Tensor, protected: Tensor, valid: Tensor, budget: Tensor,
                           budget_max: int, alpha: Any, epsilon: Any) -> Tensor:
            # The two cut-offs of criticalkv.two_stage_keep: floor(alpha * b) by s1, the rest by s2.
            candidates = valid & ~protected
            b = budget.view(-1, 1)
            num_protected = protected.sum(dim=-1)
            b1 = torch.floor(alpha * b.double()).long()
            self.cut(s1.float(), candidates, (b1 - num_protected).clamp_min(0))
            stage1 = candidates & (dense.rank_descending(torch.where(candidates, s1.float(), float("-inf")))
                                   < (b1 - num_protected).clamp_min(0).unsqueeze(-1))
            s2 = (s1.float() + epsilon) * nu.float()
            self.cut(s2, candidates & ~stage1, (b - torch.maximum(num_protected, b1)).clamp_min(0))
            return two_stage_keep(s1, nu, protected, valid, budget, budget_max, alpha, epsilon)

        reference.evict_layer, dense.topk_keep = layer_hook, topk_hook
        nacl.first_k_mask, criticalkv.two_stage_keep = first_k_hook, two_stage_hook
        try:
            yield
        finally:
            reference.evict_layer, dense.topk_keep = evict_layer, topk_keep
            nacl.first_k_mask, criticalkv.two_stage_keep = first_k_mask, two_stage_keep


def pinned_line(model: Any, case: Case) -> tuple[str, str]:
    """The case's lines: the hash of each (layer, head)'s kept positions, and its smallest gap."""
    gaps = Gaps(model.config.num_hidden_layers, model.config.num_key_value_heads)
    with gaps.watching():
        kept = reference_kept(model, case)
    return " ".join(hashes(kept)), " ".join(f"{float(g):.0e}" for g in gaps.gap.flatten())


def write() -> int:
    from vllm_evict import models
    from vllm_evict.reference import load_model

    path = models.prepare(MODEL)
    model, tokenizer = load_model(path, dtype=torch.float32)
    old = load()["kept"] if GOLDEN.exists() else {}
    kept, gaps = {}, {}
    for case in cases(tokenizer):
        kept[key(case)], gaps[key(case)] = pinned_line(model, case)
        near = sum(float(g) < NEAR_TIE for g in gaps[key(case)].split())
        print(f"{key(case)}: budget {case.budget}, {near} of {len(gaps[key(case)].split())} heads near a tie", flush=True)
    changed = [name for name, line in kept.items() if name in old and old[name] != line]
    doc = {
        "about": "written by `python -m tests.quality.kept_golden` (tests/quality/kept_golden.py says how)",
        "model": MODEL, "dtype": "float32", "setting": "aware", "ratio": RATIO, "chunk": CHUNK,
        "near_tie": NEAR_TIE,
        "prompts": {name: {"task": task, "index": index, "length": LENGTH, "tokens": len(p.ids), "sha1": tokens_hash(p.ids)}
                    for (name, (task, index)), p in zip(PROMPTS.items(), prompts(tokenizer).values())},
        "kept": kept,
        "gaps": gaps,
    }
    GOLDEN.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {GOLDEN}; changed: {', '.join(changed) if changed else 'none'}")
    return 0


if __name__ == "__main__":
    from vllm_evict.testing import use_offline_cpu_env

    use_offline_cpu_env()
    sys.exit(write())
