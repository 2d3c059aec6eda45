"""Data parallelism: ``vllm-evict serve --data-parallel-size 2`` runs two independent engine cores, each with
its own EvictScheduler, workers and plan; both serve requests, and every request evicts exactly as it
does on one engine. Pipeline parallelism is refused at start-up.

The DP server is the real one (``python -m vllm_evict serve``) on 127.0.0.1; the test compares its
greedy tokens and logprobs with the in-process TP 1 run of the same requests (``tp_outcomes``) and reads
vLLM's per-engine request counters from ``/metrics``. Only one-shot methods are compared: the two engines
batch, hence chunk, the prompts differently from the single engine, and under a chunked schedule each
chunk attends to what the previous chunks left, so outputs depend on the chunking. One-shot methods evict
once the prompt is complete, and while decoding at lengths that do not depend on the batch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

httpx = pytest.importorskip("httpx")

from tests.scaleout.helpers import (BLOCK, CHUNK, GEN_LEN, POLICIES, PROMPT_LEN, SERVER_EVICTION,  # noqa: E402
                                    requests_for)

pytestmark = [pytest.mark.engine, pytest.mark.server, pytest.mark.tp]

REPO = Path(__file__).resolve().parents[2]
ONE_SHOT = ["snapkv", "ahakv", "criticalkv+snapkv", "nacl"]
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_EVICT_TEST_SERVER_STARTUP_S", "300"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, DP coordinator, engine cores), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=30)
            time.sleep(1)  # let the group's other members exit before the SIGKILL sweep
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def dp_server(llama_kv4: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = _free_port()
    log = tmp_path_factory.mktemp("dp-server") / "server.log"
    options = {k: v for k, v in SERVER_EVICTION.items() if k not in ("policy", "budget")}
    command = [
        sys.executable, "-m", "vllm_evict", "serve", llama_kv4, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--seed", "0",
        "--max-model-len", "2048", "--max-num-batched-tokens", str(CHUNK), "--max-num-seqs", "8",
        "--block-size", str(BLOCK), "--data-parallel-size", "2",
        "--kv-eviction", SERVER_EVICTION["policy"], "--kv-budget", str(SERVER_EVICTION["budget"]),
        "--kv-eviction-config", json.dumps(options)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # DP needs the engine cores in their own processes
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                assert process.poll() is None, f"the DP server exited while starting:\n{log.read_text()[-4000:]}"
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"no /health in {STARTUP_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}"
                time.sleep(1.0)
        yield url, log
    finally:
        _stop(process)


def _complete(url: str, prompt: list[int], spec: str) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": GEN_LEN, "temperature": 0.0, "logprobs": 1,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "vllm_xargs": {"kv_eviction": spec}}
    with httpx.Client(trust_env=False, timeout=300.0) as client:
        response = client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_dp2_engines_each_evict_like_one_engine(dp_server, tp_outcomes):
    url, log = dp_server
    requests = {name: prompt["prompt_token_ids"] for name, prompt, _ in requests_for(POLICIES)
                if name in ONE_SHOT}
    assert all(len(p) == PROMPT_LEN for p in requests.values())
    with ThreadPoolExecutor(len(requests)) as pool:  # concurrent, so that both engines get requests
        bodies = dict(zip(requests, pool.map(lambda item: _complete(url, item[1], item[0]), requests.items())))
    reference = tp_outcomes("kv4", 1)
    for spec, body in bodies.items():
        choice = body["choices"][0]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(reference[spec].logprobs, abs=1e-4), spec
        assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in reference[spec].tokens], spec
    text = log.read_text(errors="replace")
    assert text.count("vllm_evict: scheduler vllm_evict.engine.scheduler.EvictScheduler") == 2, \
        "each DP engine core must run its own EvictScheduler"
    with httpx.Client(trust_env=False, timeout=30.0) as client:
        metrics = client.get(f"{url}/metrics").text
    served = {engine: float(value) for engine, value in re.findall(
        r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*finished_reason="length"[^}]*\} ([0-9.]+)$',
        metrics, flags=re.M)}
    assert sorted(served) == ["0", "1"] and sum(served.values()) == len(requests), served
    assert all(count > 0 for count in served.values()), f"one engine served nothing: {served}"


def test_pipeline_parallelism_is_refused(llama_kv4):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=llama_kv4, dtype="float32", enforce_eager=True, max_model_len=1024,
                      pipeline_parallel_size=2, additional_config={"kv_eviction": SERVER_EVICTION})
    with pytest.raises(ValueError, match="KV eviction does not support pipeline parallelism yet; use tensor parallelism"):
        args.create_engine_config()


def test_data_parallel_moe_model_is_refused(tmp_path):
    """MoE data-parallel ranks run dummy steps in lockstep; refused with eviction, accepted with DP 1."""
    from transformers import MixtralConfig
    from vllm.engine.arg_utils import EngineArgs

    MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
                  sliding_window=None).save_pretrained(tmp_path)

    def config(dp: int) -> object:
        return EngineArgs(model=str(tmp_path), dtype="float32", enforce_eager=True, max_model_len=1024,
                          skip_tokenizer_init=True, data_parallel_size=dp,
                          additional_config={"kv_eviction": SERVER_EVICTION}).create_engine_config()

    with pytest.raises(ValueError, match=r"KV eviction does not support data parallelism with MoE models \(.*\) "
                                         r"yet: idle data-parallel MoE engines run dummy steps"):
        config(2)
    assert config(1).model_config.is_moe
