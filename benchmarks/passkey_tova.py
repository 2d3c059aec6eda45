"""Passkey retrieval with TOVA in the real vLLM engine: the layer-wide mean (default) against the GQA-group
mean (``heads="group"``) and the full cache, on ~2,000-token prompts.

    python benchmarks/passkey_tova.py                 # Qwen2.5-Coder-0.5B-Instruct, 12 prompts, budget 120
    python benchmarks/passkey_tova.py --eviction-config '{"schedule": "chunked"}' --no-full

The prompts are the project's passkey recipe (tests/engine/test_quality_passkey.py: grass filler, a needle
with a new 5-digit key, raw completion, greedy, 8 new tokens; a hit is the key in the output) with the
needle at ``--prompts`` depths spread evenly from 0.04 to 0.96. One engine (tova at ``--budget``, the
engine's default schedule unless --eviction-config says otherwise); each variant is a batch of all prompts
with per-request ``extra_args``: ``{"kv_eviction": "none"}`` for the full cache,
``{"kv_eviction_config": {"heads": "group"}}`` for the group mean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_evict.testing import use_offline_cpu_env  # noqa: E402

use_offline_cpu_env()

VARIANTS: dict[str, dict[str, Any] | None] = {
    "full cache": {"kv_eviction": "none"},
    "tova, layer mean": None,  # the engine's own setting: heads="layer", the default
    "tova, group mean": {"kv_eviction_config": {"heads": "group"}},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                        help="a vllm_evict.models name or an HF folder (qwen2.5-coder-0.5b-instruct)")
    parser.add_argument("--budget", type=int, default=120, help="tokens kept per layer and KV head (120: 6%%)")
    parser.add_argument("--prompts", type=int, default=12, help="needle depths, one prompt each (12)")
    parser.add_argument("--repeats", type=int, default=81, help="filler sentences (81: ~2,000 tokens)")
    parser.add_argument("--eviction-config", type=json.loads, default={}, metavar="JSON",
                        help="more engine eviction options, e.g. '{\"schedule\": \"oneshot\"}'")
    parser.add_argument("--dtype", default="float32", help="model dtype (float32)")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache run (it does not depend on "
                                                               "--budget or --eviction-config)")
    return parser.parse_args(argv)


def model_path(name: str) -> str:
    if Path(name).is_dir():
        return name
    from vllm_evict import models

    return str(models.prepare(name))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams

    from tests.engine.test_quality_passkey import passkey_prompts

    depths = tuple(round(0.04 + i * 0.92 / max(args.prompts - 1, 1), 3) for i in range(args.prompts))
    prompts = passkey_prompts(repeats=args.repeats, depths=depths)
    keys = [key for _, key in prompts]
    eviction = {"policy": "tova", "budget": args.budget, **args.eviction_config}
    llm = LLM(model=model_path(args.model), dtype=args.dtype, enforce_eager=True, max_model_len=4096,
              max_num_batched_tokens=512, max_num_seqs=len(prompts), kv_cache_memory_bytes=1 << 30, seed=0,
              enable_prefix_caching=False, additional_config={"kv_eviction": eviction})
    lengths = [len(llm.get_tokenizer().encode(prompt)) for prompt, _ in prompts]
    print(f"eviction {eviction}; {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, "
          f"depths {list(depths)}")
    results = {}
    for name, extra in VARIANTS.items():
        if args.no_full and name == "full cache":
            continue
        params = SamplingParams(max_tokens=8, temperature=0.0, extra_args=extra)
        start = time.monotonic()
        outputs = llm.generate([prompt for prompt, _ in prompts], params, use_tqdm=False)
        texts = [out.outputs[0].text for out in outputs]
        hits = [key in text for key, text in zip(keys, texts)]
        results[name] = sum(hits)
        print(f"{name:18s} {sum(hits)}/{len(keys)}  ({time.monotonic() - start:.0f} s)  "
              f"missed at depths {[d for d, hit in zip(depths, hits) if not hit]}")
    print(json.dumps({"budget": args.budget, "prompt_tokens": [min(lengths), max(lengths)], "hits": results,
                      "eviction": eviction}))


if __name__ == "__main__":
    main()
