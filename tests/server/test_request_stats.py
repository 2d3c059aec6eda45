"""Per-request eviction stats in the HTTP responses of the session's server (tiny Llama, snapkv@64, two API
server processes; tests/server/conftest.py): completions and chat, streamed and not, with the server's
settings and with per-request overrides, checked against the shared schedule rule
(tests/eviction_oracle.py). The stats are in ``kv_transfer_params.kv_eviction``: at the top level of the
body, or of the streamed chunk that carries the choice's finish_reason. About 20 s after start-up.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.eviction_oracle import expected_run
from tests.server.conftest import CHUNK, EVICTION, MODEL, PAGE, words
from vllm_evict.request_settings import resolve_request_config
from vllm_evict.local_server import LocalServer
from vllm_evict.stats import KEY, RequestEvictionStats, eviction_stats

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

PROMPT, MAX_TOKENS = 200, 50


def body_for(endpoint: str, prompt: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def post(http: Any, endpoint: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the stats objects found, with where they were; the usage) of one request."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if not body["stream"]:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        return [{"where": "body", "stats": eviction_stats(data)}], data["usage"]
    found, usage = [], None
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            finishing = [c["index"] for c in chunk.get("choices") or () if c.get("finish_reason") is not None]
            if eviction_stats(chunk) is not None:
                found.append({"where": finishing, "stats": eviction_stats(chunk)})
    return found, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stats_are_in_the_response_and_match_the_schedule_rule(evict_server: LocalServer, http: Any,
                                                                endpoint: str, stream: bool) -> None:
    found, usage = post(http, endpoint, body_for(endpoint, words(PROMPT, 11), MAX_TOKENS, stream))
    assert len(found) == 1, found  # once per response: in the body, or on the one chunk that finishes
    assert found[0]["where"] == ("body" if not stream else [0])
    assert usage["completion_tokens"] == MAX_TOKENS
    expected = expected_run(resolve_request_config(EVICTION, None), prompt_len=usage["prompt_tokens"],
                            max_tokens=MAX_TOKENS, chunk=CHUNK, page=PAGE)
    stats = found[0]["stats"]
    assert stats == expected.stats
    assert stats.tokens_evicted == usage["prompt_tokens"] + MAX_TOKENS - 1 - stats.tokens_cached


@pytest.mark.parametrize("xargs", [{"kv_eviction": "keydiff", "kv_budget": 96},
                                   {"kv_budget": 48, "kv_eviction_config": '{"window": 16}'},
                                   {"kv_eviction": "none"}], ids=["keydiff-96", "budget-48-window-16", "none"])
def test_stats_show_the_settings_actually_applied(evict_server: LocalServer, http: Any, xargs: dict) -> None:
    found, usage = post(http, "completions", body_for("completions", words(PROMPT, 12), 40, True, vllm_xargs=xargs))
    config = resolve_request_config(EVICTION, xargs)
    expected = expected_run(config, prompt_len=usage["prompt_tokens"], max_tokens=40, chunk=CHUNK, page=PAGE)
    assert [f["stats"] for f in found] == [expected.stats]
    assert (expected.stats.policy, expected.stats.budget) == (
        (config.policy, config.budget) if config else ("none", None))


def test_openai_client_reads_the_stats(evict_server: LocalServer) -> None:
    openai = pytest.importorskip("openai")
    import httpx

    with httpx.Client(trust_env=False, timeout=120.0) as transport:
        client = openai.OpenAI(base_url=f"{evict_server.url}/v1", api_key="EMPTY", http_client=transport,
                               max_retries=0)
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": words(PROMPT, 13)}], max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True, "vllm_xargs": {"kv_budget": 80}})
    stats = eviction_stats(response.model_dump())
    assert isinstance(stats, RequestEvictionStats) and (stats.policy, stats.budget) == ("snapkv", 80)
    assert response.kv_transfer_params[KEY] == stats.to_dict()  # extra fields stay on the openai object


def test_merged_choices_get_no_misattributed_stats() -> None:
    """With n > 1 vLLM may merge two choices' outputs into one RequestOutput carrying the
    kv_transfer_params of the last: they are put on a finishing chunk only when that choice alone finished."""
    import asyncio

    from vllm.outputs import CompletionOutput, RequestOutput

    from vllm_evict.openai_server import _watch, _with_stats

    report = {KEY: {"policy": "snapkv", "budget": 64, "tokens_evicted": 1, "tokens_cached": 2,
                    "peak_tokens_cached": 3, "pages_freed": 0}}

    def output(done: list[int], params: dict | None) -> RequestOutput:
        outs = [CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                 finish_reason="length" if i in done else None) for i in (0, 1)]
        return RequestOutput("r", None, [1], None, outs, finished=len(done) == 2, kv_transfer_params=params)

    async def source():
        for item in (output([0, 1], report), output([1], report)):
            yield item

    async def run() -> dict[int, dict]:
        finished: dict[int, dict] = {}
        async for _ in _watch(source(), finished, None):
            pass
        return finished

    assert asyncio.run(run()) == {1: report}  # the merged output (both finishing) attributes nothing
    chunk = 'data: {"choices":[{"index":1,"finish_reason":"length"}]}\n\n'
    assert json.loads(_with_stats(chunk, {1: report})[len("data: "):])["kv_transfer_params"] == report
    assert _with_stats(chunk, {0: report}) == chunk
