"""Passkey retrieval with a real model (SmolLM2-135M-Instruct) in vLLM: full cache vs eviction.

PLACEHOLDER
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.engine.helpers import make_llm

pytestmark = [pytest.mark.engine, pytest.mark.slow]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
REPEATS = 80  # about 2,000 tokens of filler
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9, 0.5)
BUDGET = 512
SERVER = {"policy": "snapkv", "budget": BUDGET}
METHODS: dict[str, dict[str, Any] | None] = {  # per-request extra_args on a snapkv@512 engine
    "full": {"kv_eviction": "none"},
    "snapkv": None,  # the engine's own setting
    "keydiff": {"kv_eviction": "keydiff", "kv_budget": BUDGET},
}


def passkey_prompts(seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, key) pairs: the needle sits at each depth of the grass filler, a new 5-digit key each."""
    rng = random.Random(seed)
    prompts = []
    for depth in DEPTHS:
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        at = round(depth * REPEATS)
        haystack = FILLER * at + needle + FILLER * (REPEATS - at)
        prompts.append((HEADER + haystack.rstrip() + QUESTION, key))
    return prompts


def run_passkey(llm: Any) -> dict[str, list[bool]]:
    from vllm import SamplingParams

    prompts = passkey_prompts()
    requests, params = [], []
    for extra in METHODS.values():
        for prompt, _ in prompts:
            requests.append(prompt)
            params.append(SamplingParams(max_tokens=8, temperature=0.0, extra_args=extra))
    outputs = llm.generate(requests, params, use_tqdm=False)
    hits: dict[str, list[bool]] = {}
    for i, method in enumerate(METHODS):
        chunk = outputs[i * len(prompts):(i + 1) * len(prompts)]
        hits[method] = [key in out.outputs[0].text for (_, key), out in zip(prompts, chunk)]
        for (_, key), out in zip(prompts, chunk):
            print(f"{method:8s} key {key}: {out.outputs[0].text!r} ({len(out.prompt_token_ids)} prompt tokens)")
    return hits


def test_passkey_retrieval_full_vs_eviction(smollm2_path, engine_factory):
    engine = engine_factory(str(smollm2_path), SERVER, dtype="float32", max_model_len=4096,
                            max_num_batched_tokens=256, max_num_seqs=6, kv_cache_memory_bytes=1 << 30)
    assert type(engine.scheduler).__name__ == "EvictScheduler"
    lengths = [len(engine.llm.get_tokenizer().encode(p)) for p, _ in passkey_prompts()]
    assert all(1800 <= n <= 2300 for n in lengths), lengths  # well above the budget: eviction happens
    hits = run_passkey(engine.llm)
    counts = {method: sum(h) for method, h in hits.items()}
    print("passkey hits:", counts, "of", len(DEPTHS))
    raise AssertionError(counts)
