"""The suite through the real engine: offline ``vllm.LLM``, greedy, one engine for every configuration.

Each request carries its own method and budget in ``SamplingParams.extra_args`` (``kv_eviction``,
``kv_budget``, ``kv_eviction_config``), so one ``generate`` call runs every (method, ratio) of a sample.
The engine is started with some eviction policy (every request overrides it) and the ``ForcedTokens``
logits processor.

The two settings (``requests_for``):

* **query-aware** (``aware``): the prompt is context + question; eviction runs with the method's own
  schedule, so a one-shot method evicts once at the prompt's end with the question in its window.
  This is what a chat request is.
* **query-agnostic** (``agnostic``): the prompt is the context alone, compressed with the method's own
  schedule (one-shot at the context's end, or chunk by chunk through it); the question's tokens are then
  forced as the first output tokens (forced.py), so they enter the cache uncompressed after the
  eviction, and the answer follows. This is kvpress's query-agnostic mode (the press compresses the
  context during its prefill, the question is then fed without compression).

In both settings the budget is ``kept_tokens(span, ratio)`` for the compressed span (the whole prompt, or
the context), and each request's decode ``slack`` is set above what it generates (question + answer), so
nothing is evicted while decoding: the suite measures the prompt's compression, as kvpress and RULER do.
The realised ratio is the request's own ``tokens_evicted`` over the span (its per-request stats,
``RequestOutput.kv_transfer_params["kv_eviction"]``).

Prefix caching stays on: the one-shot configurations of a prompt share its prefill and keep what they
keep alone; those that evict chunk by chunk skip the cache (``reads_prefix_cache``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from benchmarks.quality import forced
from benchmarks.quality.methods import ALL_METHODS, Method, kept_tokens
from benchmarks.quality.prompts import Prompt
from benchmarks.quality.scoring import string_match_all

# Every request overrides the method and budget; the server reserves every method the suite runs
# (docs/security.md), and windows up to max_window (NaCl's proxies are the question's tokens). In fixed
# mode a wide max_window costs no memory (there is no query ring).
SERVER_EVICTION = {"policy": "snapkv", "budget": 64, "max_window": 1024,
                   "request_policies": sorted({m.spec for m in ALL_METHODS.values() if m.spec})}
SLACK_MARGIN = 16


@dataclass
class Request:
    prompt: Prompt
    setting: str
    method: Method
    ratio: float
    prompt_ids: list[int]
    extra_args: dict[str, Any]
    max_tokens: int
    forced: int  # leading output tokens that are the question (query-agnostic)
    span: int  # tokens the eviction compresses
    budget: int | None
    base: dict[str, Any] = field(default_factory=dict)  # the result record's common fields


def span_of(prompt: Prompt, setting: str) -> int:
    return prompt.num_tokens if setting == "aware" else len(prompt.context_ids)


def requests_for(prompt: Prompt, setting: str, method: Method, ratio: float) -> Request:
    """The engine request of one (sample, setting, method, ratio); ratio 0.0 for the full cache."""
    sample = prompt.sample
    span = span_of(prompt, setting)
    question = list(prompt.question_ids)
    agnostic = setting == "agnostic"
    extra: dict[str, Any]
    if method.spec is None:
        extra, budget = {"kv_eviction": "none"}, None
    else:
        budget = kept_tokens(span, ratio)
        generated = sample.max_new_tokens + (len(question) if agnostic else 0)
        options = {**method.options_for(len(question), span, budget), "slack": generated + SLACK_MARGIN}
        extra = {"kv_eviction": method.spec, "kv_budget": budget, "kv_eviction_config": options}
    if agnostic:
        extra[forced.KEY] = question
    return Request(prompt=prompt, setting=setting, method=method, ratio=ratio,
                   prompt_ids=list(prompt.context_ids) if agnostic else prompt.ids, extra_args=extra,
                   max_tokens=sample.max_new_tokens + (len(question) if agnostic else 0),
                   forced=len(question) if agnostic else 0, span=span, budget=budget)


def check(request: Request) -> str | None:
    """Why the engine would refuse this request's eviction settings (None: it accepts them)."""
    from vllm_evict.request_settings import resolve_request_config

    settings = {k: v for k, v in request.extra_args.items() if k != forced.KEY}
    try:
        resolve_request_config(SERVER_EVICTION, settings)
    except ValueError as err:
        return str(err)
    return None


def reads_prefix_cache(extra_args: dict[str, Any]) -> bool:
    """Whether a request may start from prompt pages another request of its batch computed (the suite's
    engine keeps vLLM's prefix caching on, so the configurations of one prompt share its prefill): all
    but those that evict chunk by chunk through the prompt, whose chunks would start at the hit's page
    instead of token 0 and keep other tokens than the request alone. A one-shot method keeps exactly what
    it keeps without prefix caching (docs/engine.md#prefix-caching; tests/quality/test_kept_tokens.py runs
    the pinned cases this way); H2O, AhaKV and CriticalKV read no cached prefix anyway (the engine's rule)."""
    from vllm_evict.request_settings import resolve_request_config

    config = resolve_request_config(SERVER_EVICTION, {k: v for k, v in extra_args.items() if k != forced.KEY})
    return config is None or config.schedule == "oneshot"


def sampling_params(extra_args: dict[str, Any], *, max_tokens: int, ignore_eos: bool) -> Any:
    """Greedy decoding with the request's eviction settings, reading the prefix cache where that keeps
    the same tokens (``reads_prefix_cache``)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, extra_args=extra_args,
                          skip_reading_prefix_cache=not reads_prefix_cache(extra_args))


def make_llm(model: str, *, dtype: str, max_model_len: int, chunk: int, max_num_seqs: int, kv_bytes: int) -> Any:
    from vllm_evict.testing import use_offline_cpu_env

    use_offline_cpu_env()
    from vllm import LLM

    return LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
               max_num_batched_tokens=chunk, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_bytes, seed=0,
               enable_prefix_caching=True, additional_config={"kv_eviction": dict(SERVER_EVICTION)},
               logits_processors=[forced.ForcedTokens])


def eos_ids(tokenizer: Any, model_path: str) -> set[int]:
    import json
    from pathlib import Path

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = Path(model_path) / "generation_config.json"
    if config.exists():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


def answer_text(tokenizer: Any, token_ids: Sequence[int], eos: set[int]) -> str:
    """The answer: the tokens up to the first end-of-sequence token, special tokens dropped."""
    cut = list(token_ids)
    for k, token in enumerate(cut):
        if token in eos:
            cut = cut[:k]
            break
    return tokenizer.decode(cut, skip_special_tokens=True)


def run(llm: Any, requests: list[Request], eos: set[int], use_tqdm: bool = True) -> list[dict[str, Any]]:
    """Run ``requests`` in one ``generate`` call; one result record per request (refused ones included,
    with ``error``)."""
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    records: list[dict[str, Any]] = []
    runnable = []
    for request in requests:
        reason = check(request)
        if reason is not None:
            records.append(record(request, error=reason))
        else:
            runnable.append(request)
    if not runnable:
        return records
    params = [sampling_params(r.extra_args, max_tokens=r.max_tokens, ignore_eos=r.forced > 0) for r in runnable]
    start = time.monotonic()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in runnable], params, use_tqdm=use_tqdm)
    seconds = time.monotonic() - start
    for request, output in zip(runnable, outputs):
        token_ids = list(output.outputs[0].token_ids)
        question = request.extra_args.get(forced.KEY, [])
        if token_ids[:request.forced] != question[:request.forced]:
            records.append(record(request, error="the forced question tokens were not generated"))
            continue
        stats = (output.kv_transfer_params or {}).get("kv_eviction")
        records.append(record(request, answer=answer_text(tokenizer, token_ids[request.forced:], eos), stats=stats,
                              answer_tokens=len(token_ids) - request.forced, batch_seconds=seconds,
                              batch_size=len(runnable)))
    return records


def record(request: Request, *, answer: str | None = None, stats: dict[str, Any] | None = None,
           error: str | None = None, **extra: Any) -> dict[str, Any]:
    sample = request.prompt.sample
    evicted = (stats or {}).get("tokens_evicted", 0)
    out = {**request.base, "backend": "engine", "setting": request.setting, "length": sample.length,
           "task": sample.task, "index": sample.index, "method": request.method.name, "ratio": request.ratio,
           "spec": request.method.spec, "options": request.extra_args.get("kv_eviction_config"),
           "budget": request.budget, "span_tokens": request.span, "prompt_tokens": request.prompt.num_tokens,
           "question_tokens": len(request.prompt.question_ids), "expected": list(sample.answers),
           "answer": answer, "score": None if answer is None else string_match_all(answer, sample.answers),
           "realised_ratio": evicted / request.span if stats is not None else (0.0 if error is None else None),
           "stats": stats, "error": error, **extra}
    return out
