"""Passkey retrieval with a real model (SmolLM2-135M-Instruct) in vLLM: full cache vs eviction.

Recipe of shared/research/small_models.md: the grass filler, the needle "The pass key is K. Remember
it. K is the pass key." at 8 depths with a new 5-digit key each, raw completion ending in "The pass
key is", greedy, 8 new tokens; a hit is the key in the output. One engine (snapkv@256), and each
method is a batch of 8 requests with per-request ``extra_args``: ``kv_eviction: none`` is the full
cache, ``keydiff`` is overridden per request.

Prompt length: ~540 tokens, not ~2k. SmolLM2 is too weak for longer prompts even with the full
cache; measured with vLLM and no eviction at all (8 prompts each): 537 tokens 8/8, 1,017 tokens 2/8,
1,497 tokens 4/8, 1,977 tokens 0/8 (0/6 with depths 0.1-0.9). So the budget is 256 of 537 tokens
(48 %).

Measured (2 cores, float32, ``.venv/bin/python -m pytest -m slow tests/engine/test_quality_passkey.py -s``;
the table it prints; about 20 s on a quiet machine, 3 min when other jobs load the cores):

=============  ==========  =============================================
method         exact key   first 3 digits of the key in the output
=============  ==========  =============================================
full cache     8/8         8/8
keydiff@256    7/8         7/8
snapkv@256     1/8         8/8  (e.g. " 604. The pass key" for 60494)
=============  ==========  =============================================

Same prompts at other budgets (per-request overrides, one method per batch): keydiff 6/8 at 192 and
3/8 at 128; snapkv 1/8 at 192 and 0/8 at 128; caote+snapkv 1/8 at 256 and 0/8 at 192. SnapKV keeps
the start of the key and loses its last digits; the HF reference runner (vllm_evict.reference)
produces the same text token for token, so this is the method on this model, not the engine.

Asserted with a margin: the full cache finds at least 7 keys; keydiff at least full - 2; snapkv
keeps the first 3 digits in at least 6 outputs; and snapkv's outputs are not all those of the full
cache (eviction really happened).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
REPEATS = 20  # filler sentences: about 540 tokens in all
DEPTHS = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95, 0.5)
BUDGET = 256
ENGINE_EVICTION = {"policy": "snapkv", "budget": BUDGET, "request_policies": ["keydiff"]}
METHODS: dict[str, dict[str, Any] | None] = {  # per-request extra_args on the snapkv@256 engine
    "full": {"kv_eviction": "none"},
    "snapkv": None,  # the engine's own setting
    "keydiff": {"kv_eviction": "keydiff", "kv_budget": BUDGET},
}


def passkey_prompts(seed: int = 0, repeats: int = REPEATS, depths: tuple[float, ...] = DEPTHS) -> list[tuple[str, str]]:
    """(prompt, key) pairs: the needle at each depth of the grass filler, a new 5-digit key each."""
    rng = random.Random(seed)
    prompts = []
    for depth in depths:
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        at = round(depth * repeats)
        haystack = FILLER * at + needle + FILLER * (repeats - at)
        prompts.append((HEADER + haystack.rstrip() + QUESTION, key))
    return prompts


def run_outputs(llm: Any, prompts: list[tuple[str, str]], extra_args: dict[str, Any] | None) -> list[Any]:
    """vLLM's outputs of greedy answers (8 tokens) to ``prompts``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, extra_args=extra_args)
    return llm.generate([prompt for prompt, _ in prompts], params, use_tqdm=False)


def run_method(llm: Any, prompts: list[tuple[str, str]], extra_args: dict[str, Any] | None) -> list[str]:
    return [out.outputs[0].text for out in run_outputs(llm, prompts, extra_args)]


def test_passkey_retrieval_full_vs_eviction(smollm2_path, engine_factory):
    engine = engine_factory(str(smollm2_path), ENGINE_EVICTION, dtype="float32", max_model_len=4096,
                            max_num_batched_tokens=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 30)
    assert type(engine.scheduler).__name__ == "EvictScheduler"
    prompts = passkey_prompts()
    keys = [key for _, key in prompts]
    lengths = [len(engine.llm.get_tokenizer().encode(prompt)) for prompt, _ in prompts]
    assert all(2 * BUDGET < n <= 600 for n in lengths), lengths  # eviction keeps under half of every prompt

    texts, seconds = {}, {}
    for method, extra in METHODS.items():
        start = time.monotonic()
        texts[method] = run_method(engine.llm, prompts, extra)
        seconds[method] = time.monotonic() - start
    hits = {method: sum(key in text for key, text in zip(keys, out)) for method, out in texts.items()}
    starts = {method: sum(key[:3] in text for key, text in zip(keys, out)) for method, out in texts.items()}
    for method, out in texts.items():
        print(f"{method:8s} hits {hits[method]}/{len(keys)}, first 3 digits {starts[method]}/{len(keys)} "
              f"({seconds[method]:.1f} s): {out}")

    assert hits["full"] >= 7, texts["full"]
    assert hits["keydiff"] >= hits["full"] - 2, texts
    assert starts["snapkv"] >= 6, texts["snapkv"]
    assert texts["snapkv"] != texts["full"], "snapkv at half the prompt changed nothing: was anything evicted?"
