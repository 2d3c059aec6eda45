"""Whatever a request carries, the real engine (offline ``LLM``, tiny Llama, in process) either serves it or
refuses it with a clear error, and goes on serving: through the front end (``VLLMValidationError``), and at
the engine's own intake for requests that bypass it (an ``EngineCoreRequest`` handed to the engine, which
finishes with reason "error" and says why in ``kv_transfer_params``)."""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from vllm.exceptions import VLLMValidationError

from tests.engine.helpers import Engine, greedy, make_llm, token_prompt
from tests.test_request_settings import OPTION_NAMES, extra_args
from vllm_evict.metrics import Metric
from vllm_evict.request_settings import REQUEST_KEYS, RESOLVED_KEY
from vllm_evict.stats import eviction_stats, refusal_reason

pytestmark = pytest.mark.engine

SERVER = {"policy": "caote+snapkv", "budget": 64, "request_policies": ["h2o", "ahakv", "criticalkv+snapkv", "nacl"]}
MAX_MODEL_LEN = 2048  # make_llm's
PROMPT = token_prompt(150, offset=5)
PROBE = token_prompt(90, offset=9)  # the normal request after each hostile batch


@pytest.fixture(scope="module")
def engine(tiny_llama: str) -> Iterator[Engine]:
    built = Engine(make_llm(tiny_llama, SERVER, max_num_seqs=8, disable_log_stats=False))
    yield built
    built.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def probe_tokens(engine: Engine) -> list[int]:
    return list(engine.llm.generate([PROBE], greedy(6))[0].outputs[0].token_ids)


def settle(engine: Engine) -> None:
    """Run the step that tells the worker the last requests finished (LLM.generate returns before it)."""
    while engine.scheduler.has_requests():
        engine.llm.llm_engine.step()


def assert_still_serving(engine: Engine, probe_tokens: list[int]) -> None:
    out = engine.llm.generate([PROBE], greedy(6))[0]
    assert list(out.outputs[0].token_ids) == probe_tokens
    settle(engine)
    assert not engine.scheduler.refused and not engine.scheduler.requests


# ---- through the front end: hypothesis over valid and hostile settings -------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(extra=extra_args)
def test_any_settings_complete_or_are_refused_and_the_engine_keeps_serving(engine, probe_tokens, extra):
    try:
        out = engine.llm.generate([PROMPT], greedy(4, **extra))[0]
    except VLLMValidationError as err:
        message = str(err)
        assert 0 < len(message) < 700
        # vLLM's own SamplingParams refuses some values before the plugin sees them (an int outside
        # [-2**63, 2**64) anywhere in extra_args), naming the parameter.
        assert any(name in message for name in (*REQUEST_KEYS, RESOLVED_KEY, "unknown key", "budget", "eviction policy",
                                                "meta score", "cannot wrap", "server", "KV cache", "extra_args",
                                                *OPTION_NAMES)), message
    else:
        assert out.finished and len(out.outputs[0].token_ids) == 4
        assert refusal_reason(out) is None
        stats = eviction_stats(out)
        assert stats is not None and (stats.budget is None or 1 <= stats.budget <= MAX_MODEL_LEN)
    assert_still_serving(engine, probe_tokens)


# ---- at the engine's intake: requests that bypass this front end --------------------------------------
def engine_core_request(engine: Engine, request_id: str, extra: dict[str, Any] | None) -> Any:
    """An EngineCoreRequest as another front end would send it: processed by vLLM, then given ``extra``
    as its extra_args, untouched by this plugin's front end."""
    request = engine.llm.llm_engine.input_processor.process_inputs(request_id, PROMPT, greedy(4),
                                                                   supported_tasks=("generate",))
    request.sampling_params.extra_args = extra
    return request


def run_raw(engine: Engine, request: Any) -> Any:
    llm_engine = engine.llm.llm_engine
    llm_engine.add_request(request.request_id, request, request.sampling_params)
    finished = []
    while llm_engine.has_unfinished_requests() or engine.scheduler.has_requests():
        finished.extend(o for o in llm_engine.step() if o.finished)
    (out,) = finished
    return out


def rejections(engine: Engine) -> float:
    spec = Metric.REJECTED_REQUESTS.value
    found = [m.value for m in engine.llm.get_metrics() if m.name == spec.name and m.labels.get("reason") == "engine_intake"]
    return found[0] if found else 0.0


@pytest.mark.parametrize("extra,fragment", [
    ({"kv_eviction_config": '{"seed": 9223372036854775808}'}, "seed must be an integer in [0, 9223372036854775807]"),
    ({"kv_eviction": "keydiff", "kv_budget": 18446744073709551616}, "kv_budget must be an integer in [1, 2048]"),
    ({"kv_eviction_config": '{"pooling": "max", "kernel": 134217729}'}, "kernel must be an odd integer in [1, 31]"),
    ({"kv_budget": 1024, "kv_eviction_config": '{"window": 200}'}, "must be at most the server's max_window, 32 queries, got 200"),
    ({"kv_eviction_config": "[" * 3000}, "kv_eviction_config is nested too deeply"),
    ({"kv_eviction": "tova", "kv_eviction_config": {"mode": "elastic"}}, "mode 'elastic' needs a server started in"),
    ({RESOLVED_KEY: {"policy": "snapkv", "budget": 64, "max_window": 4096}}, f"{RESOLVED_KEY} may not set server"),
    ({RESOLVED_KEY: {"policy": "keydiff", "budget": -3}}, "budget must be an integer in [1, 2147483647], got -3"),
    ({"kv_evictoin": "h2o"}, "unknown key 'kv_evictoin'"),
])
def test_the_engine_refuses_a_bad_request_that_bypassed_the_front_end(engine, probe_tokens, extra, fragment):
    before = rejections(engine)
    out = run_raw(engine, engine_core_request(engine, f"raw-{abs(hash(fragment))}", extra))
    assert out.outputs[0].finish_reason == "error" and not out.outputs[0].token_ids
    assert fragment in refusal_reason(out), refusal_reason(out)
    assert rejections(engine) == before + 1
    assert_still_serving(engine, probe_tokens)


def test_the_engine_resolves_raw_settings_that_bypassed_the_front_end(engine, probe_tokens):
    out = run_raw(engine, engine_core_request(engine, "raw-good", {"kv_eviction": "h2o", "kv_budget": 48,
                                                                   "kv_eviction_config": '{"recent": 8}'}))
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    stats = eviction_stats(out)
    assert stats.policy == "h2o" and stats.budget == 48 and stats.tokens_evicted > 0
    assert_still_serving(engine, probe_tokens)


# ---- the output path: per-request stats always encode ------------------------------------------------------
def test_stats_of_extreme_valid_settings_go_through_vllms_encoder(engine, probe_tokens):
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    extreme = {"kv_eviction": "nacl", "kv_budget": MAX_MODEL_LEN,
               "kv_eviction_config": '{"seed": 9223372036854775807, "slack": 2048, "temperature": 10000}'}
    outs = engine.llm.generate([PROMPT, PROMPT], [greedy(4, **extreme), greedy(4, kv_budget=33, kv_eviction="snapkv")])
    for out in outs:
        params = out.kv_transfer_params
        eco = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=out.request_id, new_token_ids=[1],
                                                          kv_transfer_params=params)],
                                scheduler_stats=engine.scheduler.make_stats())
        wire = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(eco))
        assert wire.outputs[0].kv_transfer_params == params
        assert msgspec.json.decode(msgspec.json.encode(params)) == params  # and the OpenAI body's JSON
    assert eviction_stats(outs[0]).budget == MAX_MODEL_LEN
    assert_still_serving(engine, probe_tokens)


# ---- bounded tables ---------------------------------------------------------------------------------------
def test_hundreds_of_distinct_configs_leave_the_tables_small(engine, probe_tokens):
    """Every request a new seed and budget: the worker's policy table and the scheduler's per-request maps
    hold only what the running requests use, and forget it with them."""
    runner, scheduler = engine.runner, engine.scheduler
    prompts = [token_prompt(40, offset=i) for i in range(8)]
    for batch in range(25):  # 200 requests, 200 distinct configs
        params = [greedy(1, kv_budget=33 + (batch * 8 + i) % 900,
                         kv_eviction_config={"seed": 1000 * batch + i}) for i in range(8)]
        engine.llm.generate(prompts, params)
        assert len(runner.evict_policies) <= 8 + 1 + 8  # the server's entry + the running ones (+ finishing)
    assert_still_serving(engine, probe_tokens)
    assert runner.evict_policies.live() == 1  # only the server's own config is left
    assert not scheduler.eviction_configs and not scheduler.accounting.requests and not scheduler.evicted
    assert not runner.evict_rows.policy_of
