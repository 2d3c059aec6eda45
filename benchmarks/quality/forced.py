"""A vLLM logits processor that makes a request's first output tokens a given sequence.

The suite's query-agnostic setting needs the question appended to a context whose cache has already
been evicted: the request's prompt is the context alone (so eviction, one-shot at its end or chunked
through it, sees no question), and the question's tokens are then *forced* as the first output tokens
(greedy decoding picks them because every other logit is -inf). Each forced token enters the cache like
any decoded token, at the next logical position, uncompressed as long as the request's decode slack is
larger than the question plus the answer. The answer is what follows the forced tokens.

Per request: ``SamplingParams.extra_args["forced_tokens"] = [ids...]``; requests without it are untouched.
The engine needs ``LLM(..., logits_processors=[ForcedTokens])``.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

KEY = "forced_tokens"


class ForcedTokens(AdapterLogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        forced = (sampling_params.extra_args or {}).get(KEY)
        if forced is not None and (not isinstance(forced, list) or not all(isinstance(t, int) for t in forced)):
            raise ValueError(f"{KEY} must be a list of token ids, got {forced!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        forced = (params.extra_args or {}).get(KEY)
        if not forced:
            return None
        tokens = list(forced)

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            step = len(output_ids)
            if step < len(tokens):
                token = tokens[step]
                logits.fill_(float("-inf"))
                logits[token] = 0.0
            return logits

        return force
