"""Offline eviction demo through the HF reference runner: the same prompt with and without eviction.

    python -m vllm_evict.demo [--policy snapkv] [--budget 64] [--max-new-tokens 24] [--model NAME]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_PROMPT = (
    "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
    + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 5
    + "The pass key is 68231. Remember it. 68231 is the pass key. "
    + "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 5
    + "\n\nWhat is the pass key? The pass key is"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_evict.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model name from vllm_evict.models (default: smollm2-135m-instruct)")
    parser.add_argument("--policy", default="snapkv", help="eviction policy spec, e.g. snapkv, h2o, caote+snapkv")
    parser.add_argument("--budget", type=int, default=64, help="tokens kept per layer and KV head")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=32, help="prompt tokens per prefill step")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from vllm_evict import models, reference
    from vllm_evict.config import EvictionConfig

    try:
        config = EvictionConfig.from_spec(args.policy, args.budget)
        path = models.prepare(args.model or models.DEFAULT_MODEL)
    except (ValueError, models.ModelPrepareError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest on a small shared machine
    model, tokenizer = reference.load_model(path, dtype=torch.float32)
    prompt_ids = reference.prompt_token_ids(tokenizer, args.prompt)
    print(f"model: {path.name}   prompt: {len(prompt_ids)} tokens   chunk: {args.chunk_size}")
    print(f"eviction: {config}")
    for label, cfg in (("full cache", None), (f"{config.policy} @ {config.budget}", config)):
        start = time.perf_counter()
        result = reference.run_reference(model, prompt_ids, cfg, args.max_new_tokens, chunk_size=args.chunk_size,
                                         tokenizer=tokenizer)
        elapsed = time.perf_counter() - start
        counts = result.kept_counts
        logical = result.prompt_len + len(result.token_ids) - 1
        print(f"\n[{label}] {elapsed:.2f} s, {len(result.token_ids)} tokens, "
              f"mean logprob {sum(result.logprobs) / max(1, len(result.logprobs)):.3f}")
        print(f"  output: {result.text!r}")
        print(f"  kept per (layer, KV head): {min(counts)}..{max(counts)} of {logical} logical tokens; "
              f"{len(result.trace)} layer evictions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
