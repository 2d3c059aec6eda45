"""Hostile per-request settings against the real server (the session's ``vllm-evict serve`` on loopback, see
conftest.py: tiny Llama, snapkv with budget 64, max_model_len 2048, two API servers): each one gets HTTP 400
with a message naming what to change (and never a long echo of what it sent), the server stays healthy and
answers a normal request after each, the rejection metric counts them, and the resident memory of the
engine core and its worker stays put.

Every request of the issue that once broke the server is here (#19: a seed or budget beyond int64, a huge
pooling kernel, a window wider than what the server reserved, NaN, deep nesting, a megabyte of text, a method
the server cannot serve)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.conftest import MODEL, words
from vllm_evict.local_server import LocalServer, sample

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

NESTED = "[" * 2000 + "]" * 2000  # 4000 characters: within the size limit, deeper than the parser goes
# (name, vllm_xargs as JSON text (NaN and huge numbers need it), a fragment of the expected message)
HOSTILE = [
    ("seed-2**63", '{"kv_eviction": "h2o", "kv_eviction_config": "{\\"seed\\": 9223372036854775808}"}',
     "seed must be an integer in [0, 9223372036854775807], got 9223372036854775808"),
    ("budget-2**64", '{"kv_eviction": "keydiff", "kv_budget": 18446744073709551616}',
     "kv_budget must be an integer in [1, 2048], got 18446744073709551616"),
    ("budget-in-config", '{"kv_eviction": "keydiff", "kv_eviction_config": "{\\"budget\\": 18446744073709551616}"}',
     "kv_eviction_config: set the budget with kv_budget, not with budget in kv_eviction_config"),
    ("slack-2**63", '{"kv_eviction_config": "{\\"slack\\": 9223372036854775807}"}',
     "slack must be an integer in [1, 2048], got 9223372036854775807"),
    ("kernel-134217729", '{"kv_eviction_config": "{\\"pooling\\": \\"max\\", \\"kernel\\": 134217729}"}',
     "kernel must be an odd integer in [1, 31] (pooling keeps the length), got 134217729"),
    ("window-200", '{"kv_budget": 1024, "kv_eviction_config": "{\\"window\\": 200}"}',
     "query window at budget 1024 must be at most the server's max_window, 32 queries, got 200"),
    ("window-4096", '{"kv_budget": 2048, "kv_eviction_config": "{\\"window\\": 2000}"}',
     "must be at most the server's max_window, 32 queries, got 2000"),
    ("nan-literal", '{"kv_eviction": "nacl", "kv_eviction_config": "{\\"temperature\\": NaN}"}',
     "kv_eviction_config: NaN is not a number here; numbers must be finite"),
    ("infinity-literal", '{"kv_eviction_config": "{\\"window\\": Infinity}"}', "Infinity is not a number here"),
    ("nan-budget", '{"kv_budget": NaN}', "kv_budget must be an integer in [1, 2048], got nan"),
    ("float-overflow", '{"kv_eviction": "nacl", "kv_eviction_config": "{\\"random_ratio\\": 1e999}"}',
     "random_ratio must be a number in [0, 1], got inf"),
    ("deep-nesting", json.dumps({"kv_eviction_config": NESTED}), "kv_eviction_config is nested too deeply"),
    ("nested-value", '{"kv_eviction_config": "{\\"window\\": {\\"a\\": [1]}}"}',
     "window must be an integer in [1, 2147483647], got a JSON object of 1 entries"),
    ("megabyte-config", json.dumps({"kv_eviction_config": "x" * 1_000_000}),
     "kv_eviction_config must be a JSON object of at most 4096 characters, got 1000000"),
    ("megabyte-policy", json.dumps({"kv_eviction": "x" * 1_000_000}),
     "unknown eviction policy 'xxxxxxxx"),
    ("duplicate-keys", '{"kv_eviction_config": "{\\"window\\": 8, \\"window\\": 9}"}',
     "kv_eviction_config has the key 'window' twice"),
    ("unknown-option", '{"kv_eviction_config": "{\\"windw\\": 8}"}', "unknown option 'windw' for snapkv"),
    ("unknown-key", '{"kv_evictoin": "h2o"}', "unknown key 'kv_evictoin'; the eviction keys are kv_eviction"),
    ("server-option", '{"kv_eviction_config": "{\\"max_window\\": 4096}"}', "max_window is a server option"),
    ("server-policies", '{"kv_eviction_config": "{\\"request_policies\\": [\\"h2o\\"]}"}',
     "request_policies is a server option"),
    ("elastic", '{"kv_eviction_config": "{\\"mode\\": \\"elastic\\"}"}', "mode 'elastic' needs a server started in"),
    ("criticalkv", '{"kv_eviction": "criticalkv+snapkv"}',
     "criticalkv+snapkv needs each attention layer's output projection (o_proj), which this server did not load"),
    ("four-states", '{"kv_eviction": "criticalkv+ahakv"}', "which this server did not load at start-up"),
    ("unreserved-state", '{"kv_eviction": "h2o"}', "h2o needs the per-token state 'acc', which this server did "
                                                   "not reserve at start-up; add 'h2o' to the server's request_policies"),
    ("policy-list", '{"kv_eviction": ["snapkv"]}', "kv_eviction must be a method such as 'snapkv' or 'none', got a "
                                                   "list of 1 entries"),
    ("budget-string", '{"kv_budget": "64"}', "kv_budget must be an integer in [1, 2048], got '64'"),
]
REASONS = {"criticalkv": "not_reserved", "four-states": "not_reserved", "unreserved-state": "not_reserved",
           "window-200": "not_reserved", "window-4096": "not_reserved", "elastic": "not_reserved"}
# An accepted window of 2000 would have grown the worker's query ring to 2000 queries x 8 sequences x 2 layers
# x 4 query heads x 32 x 4 bytes = 15.6 MiB (as before #19); the hostile set must leave the engine core's
# resident memory (engine core + worker) within half of that.
RSS_BOUND = 8 * 2**20


def post(http: Any, endpoint: str, xargs_json: str, **fields: Any) -> Any:
    if endpoint == "/v1/completions":
        body = {"model": MODEL, "prompt": words(100, 3), "max_tokens": 4}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": words(60, 5)}], "max_tokens": 4}
    text = json.dumps({**body, **fields})[:-1] + ', "vllm_xargs": ' + xargs_json + "}"
    return http.post(endpoint, content=text.encode(), headers={"Content-Type": "application/json"})


def engine_processes(server: LocalServer) -> list[Any]:
    """The engine core and its worker (the model, the KV cache and eviction's buffers live there)."""
    root = psutil.Process(server.process.pid)
    found = [p for p in root.children(recursive=True)
             if any(tag in " ".join([p.name(), *p.cmdline()]) for tag in ("EngineCore", "VLLM::Worker"))]
    assert any("EngineCore" in p.name() for p in found), [(p.pid, p.name()) for p in root.children(recursive=True)]
    return found


def resident(processes: list[Any]) -> int:
    return sum(p.memory_info().rss for p in processes)


def normal(http: Any) -> list[Any]:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": words(200, 7), "max_tokens": 8,
                                                  "temperature": 0.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_every_hostile_request_gets_a_400_and_the_server_stays_whole(evict_server: LocalServer, http: Any) -> None:
    engine = engine_processes(evict_server)
    expected = normal(http)
    for _ in range(3):  # warm-up: the allocator settles
        assert normal(http) == expected
    rss_before = resident(engine)
    before = evict_server.metrics(http)
    for i, (name, xargs, fragment) in enumerate(HOSTILE):
        endpoint = "/v1/completions" if i % 2 == 0 else "/v1/chat/completions"
        for stream in (False, True):
            response = post(http, endpoint, xargs, stream=stream)
            assert response.status_code == 400, f"{name}: {response.status_code} {response.text[:500]}"
            message = response.json()["error"]["message"]
            assert fragment in message, f"{name}: {message}"
            assert len(response.text) < 1000, f"{name}: a {len(response.text)}-character answer"
        assert http.get("/health").status_code == 200, name
        assert normal(http) == expected, name
    assert evict_server.alive() and all(p.is_running() for p in engine)
    after = evict_server.metrics(http)
    for reason in ("invalid_settings", "not_reserved"):
        count = 2 * sum(1 for name, _, _ in HOSTILE if REASONS.get(name, "invalid_settings") == reason)
        got = (sample(after, "vllm:kv_eviction_rejected_requests_total", reason=reason)
               - sample(before, "vllm:kv_eviction_rejected_requests_total", reason=reason))
        assert got == count, (reason, got, count)
    growth = resident(engine) - rss_before
    print(f"engine core + worker resident memory: {rss_before / 2**20:.1f} MiB before, {growth / 2**20:+.2f} MiB "
          f"after {len(HOSTILE) * 2} hostile and {len(HOSTILE) + 4} normal requests")
    assert growth < RSS_BOUND, f"the engine core and worker grew by {growth / 2**20:.1f} MiB over the hostile requests"


def test_nacl_with_a_large_budget_is_served_within_max_window(evict_server: LocalServer, http: Any) -> None:
    """NaCl's automatic proxy count is capped by the server's max_window instead of growing its buffers."""
    response = post(http, "/v1/completions", '{"kv_eviction": "nacl", "kv_budget": 2048}')
    assert response.status_code == 200, response.text
    stats = response.json()["kv_transfer_params"]["kv_eviction"]
    assert stats["policy"] == "nacl" and stats["budget"] == 2048
