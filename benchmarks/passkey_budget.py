"""Pass-key retrieval at a small budget: which methods keep a 5-digit key in ~2.1k-token prompts.

Qwen2.5-Coder-0.5B-Instruct in float32 through the real engine, the pass-key recipe of
tests/engine/test_quality_passkey.py (grass filler, raw completion, greedy, 8 new tokens, a hit = the key
in the output) with 85 filler sentences (2,094 tokens) and 12 needle depths from 0.04 to 0.92, every
configuration at the same budget (128 tokens: 6% of the prompt). Prints one JSON line per configuration.

    .venv/bin/python -m benchmarks.passkey_budget                       # the configurations below
    .venv/bin/python -m benchmarks.passkey_budget --budget 256 --methods snapkv,ahakv

About 5 minutes per configuration on one core of the 2-core CPU machines.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

# name -> (method, options): the AhaKV readings of issue #30's ablation beside SnapKV and NaCl.
CONFIGURATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "snapkv": ("snapkv", {}),
    "ahakv": ("ahakv", {}),
    "ahakv:gain=raw:pooling=none": ("ahakv", {"gain": "raw", "pooling": "none"}),
    "nacl": ("nacl", {}),
    "nacl:random=0": ("nacl", {"random_ratio": 0.0}),
}
DEPTHS = tuple(round(0.04 + i * 0.08, 2) for i in range(12))
REPEATS = 85  # filler sentences: 2,094 tokens with Qwen2.5's tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--methods", default=",".join(CONFIGURATIONS),
                        help=f"comma-separated, from: {', '.join(CONFIGURATIONS)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGURATIONS)}")

    from vllm_evict import models
    from vllm_evict.testing import use_offline_cpu_env

    use_offline_cpu_env()
    from vllm import LLM

    from tests.engine.test_quality_passkey import passkey_prompts, run_method

    server = {"policy": "snapkv", "budget": args.budget,
              "request_policies": sorted({CONFIGURATIONS[n][0] for n in names})}
    llm = LLM(model=str(models.prepare("qwen2.5-coder-0.5b-instruct")), dtype="float32", enforce_eager=True,
              max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=len(DEPTHS),
              kv_cache_memory_bytes=1 << 30, seed=0, enable_prefix_caching=False,
              additional_config={"kv_eviction": server})
    prompts = passkey_prompts(repeats=REPEATS, depths=DEPTHS)
    tokens = sorted({len(llm.get_tokenizer().encode(prompt)) for prompt, _ in prompts})
    for name in names:
        method, options = CONFIGURATIONS[name]
        extra = {"kv_eviction": method, "kv_budget": args.budget, **({"kv_eviction_config": options} if options else {})}
        start = time.monotonic()
        texts = run_method(llm, prompts, extra)
        hits = sum(key in text for (_, key), text in zip(prompts, texts))
        print(json.dumps({"method": name, "budget": args.budget, "prompt_tokens": tokens, "hits": hits,
                          "of": len(prompts), "seconds": round(time.monotonic() - start)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
