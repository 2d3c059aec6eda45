"""The real OpenAI-compatible server (``python -m vllm_evict serve``) with eviction on, over HTTP.

One server for the whole module, started as a subprocess on 127.0.0.1: SmolLM2-135M-Instruct with
``--kv-eviction snapkv --kv-budget 128``. The prompts are about 490 tokens, so every request that keeps
the server's settings really evicts. Its log goes to a file whose path (and tail) failures print.

Run alone: ``.venv/bin/python -m pytest -m server tests/server -v``: about 40 s on a quiet 2-core
machine (25 s of it start-up), 2 min when other jobs load the cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="the server tests need vLLM (make install)")
httpx = pytest.importorskip("httpx")

from vllm_evict.request_settings import resolve_request_config  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"  # --served-model-name
SERVER_EVICTION = {"policy": "snapkv", "budget": 128}
MAX_MODEL_LEN = 2048
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_EVICT_TEST_SERVER_STARTUP_S", "240"))
REQUEST_TIMEOUT_S = 120.0

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PROMPT = FILLER * 20 + "\nWhat color is the grass? The grass is"  # 491 tokens with SmolLM2's tokenizer
LONG_TOKENS = 24  # decode steps of the request that runs while bad ones arrive
LONG = 400  # every eviction test prompt has at least this many tokens (> 3x the budget)

# Per-request settings the front end must refuse, with a piece of the message each must carry.
BAD_XARGS = [
    ({"kv_budget": -5}, "kv_budget must be an integer in [1, 2048], got -5"),
    ({"kv_eviction": "nope"}, "unknown eviction policy 'nope'"),
    ({"kv_budget": 8}, "budget 8 must be larger than the 32 tokens snapkv always keeps"),
    ({"kv_eviction": "none", "kv_budget": 64}, "kv_eviction 'none' turns eviction off for this request"),
]


@dataclass
class Server:
    url: str
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return f"--- last {lines} lines of {self.log} ---\n" + "\n".join(self.log_text().splitlines()[-lines:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(1)  # the group's other members exit right after the leader; SIGKILL any straggler
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("openai-server") / "server.log"
    command = [
        sys.executable, "-m", "vllm_evict", "serve", str(smollm2_path), "--served-model-name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "128", "--max-num-seqs", "8",
        "--block-size", "32", "--kv-eviction", SERVER_EVICTION["policy"],
        "--kv-budget", str(SERVER_EVICTION["budget"])]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine tests' in-process switch; the server runs as served
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    running = Server(url=f"http://127.0.0.1:{port}", log=log, process=process)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if process.poll() is not None:
                    pytest.fail(f"the server exited with status {process.returncode} while starting\n"
                                f"{running.log_tail()}")
                try:
                    if client.get(f"{running.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"the server did not answer /health within {STARTUP_TIMEOUT_S:.0f} s\n"
                                f"{running.log_tail()}")
                time.sleep(1.0)
        yield running
    finally:
        stop(process)
        print(f"\n[server log: {log}]")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        yield http


@pytest.fixture(scope="module")
def openai_client(server: Server) -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    with httpx.Client(trust_env=False, timeout=REQUEST_TIMEOUT_S) as http:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", http_client=http, max_retries=0)


def complete(client: Any, server: Server, xargs: dict[str, Any] | None = None, *, max_tokens: int = 6,
             **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                            "logprobs": 1, "ignore_eos": True, **extra}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, f"{response.status_code} {response.text}\n{server.log_tail()}"
    return response.json()


def token_logprobs(body: dict[str, Any]) -> list[float]:
    return body["choices"][0]["logprobs"]["token_logprobs"]


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def expected_error(xargs: dict[str, Any]) -> str:
    with pytest.raises(ValueError) as info:
        resolve_request_config(SERVER_EVICTION, xargs, max_model_len=MAX_MODEL_LEN)
    return str(info.value)


# ---- start-up ------------------------------------------------------------------------------------
def test_server_runs_the_evict_scheduler(server: Server, client: Any) -> None:
    log = server.log_text()
    assert "vllm_evict: scheduler vllm_evict.engine.scheduler.EvictScheduler" in log, server.log_tail()
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


# ---- completions with eviction -----------------------------------------------------------------
@pytest.fixture(scope="module")
def references(server: Server, client: Any) -> dict[str, dict[str, Any]]:
    """The same greedy completion with the server's eviction, with ``kv_eviction: none`` and with a
    budget above the prompt length (each request costs seconds on 2 loaded cores: made once)."""
    return {"evicted": complete(client, server), "full": complete(client, server, {"kv_eviction": "none"}),
            "roomy": complete(client, server, {"kv_budget": 1024})}


def test_completion_with_eviction(references: dict[str, dict[str, Any]]) -> None:
    body = references["evicted"]
    choice = body["choices"][0]
    assert choice["text"].strip(), body
    assert body["usage"]["prompt_tokens"] >= LONG > 3 * SERVER_EVICTION["budget"]
    assert body["usage"]["completion_tokens"] == 6
    assert "green" in choice["text"].lower(), body  # the prompt is all about it; a broken cache loses that


def test_eviction_really_happens_and_none_turns_it_off(references: dict[str, dict[str, Any]]) -> None:
    """Server default (snapkv, 128 of ~490 tokens) must differ from the full cache; ``kv_eviction: none``
    and a budget above the prompt length must both be the full cache exactly."""
    evicted, full, roomy = (token_logprobs(references[k]) for k in ("evicted", "full", "roomy"))
    assert references["full"]["choices"][0]["text"].strip()
    assert max_gap(full, roomy) < 1e-4, (full, roomy)
    assert max_gap(full, evicted) > 1e-3, (full, evicted)


def test_chat_completion_with_eviction(server: Server, client: Any) -> None:
    question = FILLER * 20 + "\nWhat color is the grass?"
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 8,
        "temperature": 0.0})
    assert response.status_code == 200, f"{response.status_code} {response.text}\n{server.log_tail()}"
    body = response.json()
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip(), body
    assert body["usage"]["prompt_tokens"] >= LONG
    assert 0 < body["usage"]["completion_tokens"] <= 8


# ---- per-request overrides through the openai client --------------------------------------------
def test_per_request_override_via_openai_client(openai_client: Any,
                                                references: dict[str, dict[str, Any]]) -> None:
    override = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=1,
        extra_body={"ignore_eos": True, "vllm_xargs": {"kv_budget": 96, "kv_eviction": "keydiff"}})
    assert override.choices[0].text.strip()
    assert override.usage.prompt_tokens >= LONG and override.usage.completion_tokens == 6
    got = override.choices[0].logprobs.token_logprobs
    default, full = token_logprobs(references["evicted"]), token_logprobs(references["full"])
    # Neither the server's snapkv@128 nor the full cache: the override was applied.
    assert max_gap(got, full) > 1e-3 and max_gap(got, default) > 1e-3, (got, default, full)


def test_chat_override_via_openai_client(openai_client: Any) -> None:
    chat = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": FILLER * 20 + "\nWhat color is the sky?"}],
        max_tokens=4, temperature=0.0, extra_body={"vllm_xargs": {"kv_eviction": "caote+snapkv", "kv_budget": 160}})
    assert chat.choices[0].message.content.strip()
    assert chat.usage.prompt_tokens >= LONG


def test_kv_eviction_config_override_over_http(server: Server, client: Any) -> None:
    """vllm_xargs values are strings, numbers or lists (vLLM's OpenAI schema): the object is JSON text."""
    response = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2,
        "vllm_xargs": {"kv_eviction_config": '{"window": 16}'}})
    assert response.status_code == 200, response.text
    bad = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 2,
        "vllm_xargs": {"kv_eviction_config": '{"window": -1}'}})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == ("invalid per-request KV eviction settings: window must be an "
                                              "integer in [1, 2147483647], got -1")


def test_openai_client_gets_bad_request_error(openai_client: Any) -> None:
    import openai

    xargs, fragment = BAD_XARGS[1]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                         extra_body={"vllm_xargs": xargs})
    assert info.value.status_code == 400
    assert expected_error(xargs) in str(info.value) and fragment in str(info.value)


# ---- refused settings ----------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("xargs,fragment", BAD_XARGS, ids=[str(x) for x, _ in BAD_XARGS])
def test_bad_settings_get_400_with_the_config_message(server: Server, client: Any, endpoint: str,
                                                      xargs: dict[str, Any], fragment: str) -> None:
    message = expected_error(xargs)
    assert fragment in message  # the config module still refuses it for the expected reason
    if endpoint == "/v1/completions":
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    response = client.post(endpoint, json={**body, "vllm_xargs": xargs})
    assert response.status_code == 400, f"{response.status_code} {response.text}"
    assert response.json()["error"]["message"] == message, response.text


def test_server_keeps_serving_during_and_after_bad_requests(server: Server, client: Any) -> None:
    """A long request runs while bad and good ones arrive; all get their answers, and the server goes on."""
    results: dict[str, Any] = {}

    def long_request() -> None:
        try:
            results["long"] = complete(client, server, max_tokens=LONG_TOKENS)
        except BaseException as err:  # reported below
            results["long"] = err

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.5)
    statuses = []
    for xargs, _ in BAD_XARGS:
        response = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                        "vllm_xargs": xargs})
        statuses.append(response.status_code)
    short = complete(client, server, {"kv_budget": 64}, max_tokens=4)
    worker.join(timeout=REQUEST_TIMEOUT_S)
    assert not worker.is_alive(), "the long request did not finish"
    assert statuses == [400] * len(BAD_XARGS)
    long = results["long"]
    assert isinstance(long, dict), long
    assert long["usage"]["completion_tokens"] == LONG_TOKENS and long["choices"][0]["text"].strip()
    assert short["usage"]["completion_tokens"] == 4
    assert client.get("/health").status_code == 200
    assert server.process.poll() is None, server.log_tail()
