"""Helpers for tests that run the real vLLM V1 engine on CPU, in process, on the model runner the suite
was started for (``VLLM_EVICT_TEST_RUNNER``, see tests/conftest.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# In-process engine: fast start-up, and the scheduler and runner can be inspected directly.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

# "v1": vLLM's V1 model runner; "v2": Model Runner V2 (tests/conftest.py makes vLLM choose it).
TEST_RUNNER = os.environ.get("VLLM_EVICT_TEST_RUNNER", "v1")
BLOCK = 32
# The server of the suite's one multiprocess-engine run (tests/engine/conftest.py::multiprocess_run).
MULTIPROCESS_SERVER = {"policy": "snapkv", "budget": 64}
PAGE_BYTES_TINY = 2 * 2 * 32 * 2 * 4 * BLOCK  # layers * kv heads * head_dim * (K, V) * fp32 * tokens


def make_llm(model: str, eviction: dict[str, Any] | None = None, *, pages: int = 512, **overrides: Any) -> LLM:
    kwargs: dict[str, Any] = dict(
        model=model, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=4,
        max_num_batched_tokens=64, block_size=BLOCK, kv_cache_memory_bytes=pages * PAGE_BYTES_TINY,
        seed=0, enable_prefix_caching=False)
    kwargs.update(overrides)
    if eviction is not None:
        kwargs["additional_config"] = {"kv_eviction": eviction}
    return LLM(**kwargs)


@dataclass
class Engine:
    llm: LLM

    @property
    def core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def runner(self) -> Any:
        return self.core.model_executor.driver_worker.worker.model_runner

    def free_pages(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def total_pages(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1  # minus the null page

    def pages_of(self, request_id: str) -> int:
        return len(self.scheduler.attention_manager.req_to_blocks.get(request_id, ()))


def greedy(max_tokens: int, **extra_args: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True,
                          extra_args=extra_args or None)


def token_prompt(length: int, offset: int = 1, vocab: int = 500) -> dict[str, list[int]]:
    """Deterministic, varied token ids (the tiny model has no meaningful text)."""
    return {"prompt_token_ids": [(offset + 37 * i + (i * i) % 11) % vocab for i in range(length)]}


def chosen_logprobs(output: Any) -> list[float]:
    completion = output.outputs[0]
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def runner_kind(runner: Any) -> str:
    """"v1" or "v2": the vLLM model runner under ``runner`` (with or without the eviction mixin)."""
    import sys

    v2 = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    return "v2" if v2 is not None and isinstance(runner, v2.GPUModelRunner) else "v1"


def assert_worker_rows_clean(engine: Engine, pending_finish: bool = True) -> None:
    """The worker holds eviction state only for requests that are alive: in the rows vLLM's runner holds
    (V1: the rows of its batch; V2: the requests' slots), and for running requests a V1 step left out
    (parked). The worker hears of a finish with the next step, as vLLM's own runner does, so the runner
    may still hold requests the scheduler has finished (``pending_finish``; False asserts it holds none)."""
    runner = engine.runner
    rows = runner.evict_rows
    held = runner.evict_view.held_rows()
    free = np.ones(len(rows.policy), dtype=bool)
    free[list(held.values())] = False
    assert (rows.policy[free] == -1).all() and (rows.evicted[free] == 0).all() and (rows.cached[free] == 0).all()
    assert (rows.slot[free] == -1).all()
    alive = set(engine.scheduler.requests)
    assert set(rows.parked) <= alive, "the worker keeps state for a finished request"
    assert set(rows.slot_of) <= alive | set(held), "a finished request still owns a ring slot"
    if not pending_finish:
        assert set(held) <= alive


def cached_pages(runner: Any, request_id: str, tokens: int) -> Any:
    """The pages holding a request's first ``tokens`` cached tokens, [pages] on the runner's device."""
    pages = -(-tokens // runner.evict_buffers.geometry.page_size)
    return runner.evict_view.page_table([request_id], pages, runner.evict_builder.staging.to_device)[0].long()


def engine_kept_positions(engine: "Engine", prompt_ids: list[int], params: Any) -> tuple[Any, list[Any]]:
    """Generate one request; its output and the logical positions each layer kept per KV head, sorted."""
    import torch

    runner = engine.runner
    runner.evict_kept_record = {}
    output = engine.llm.generate([{"prompt_token_ids": prompt_ids}], params)[0]
    # The worker hears of the finish with the next step: run one tiny request to deliver it.
    engine.llm.generate([{"prompt_token_ids": prompt_ids[:3]}], greedy(1, kv_eviction="none"))
    (kept,) = runner.evict_kept_record.values()
    return output, [torch.sort(layer, dim=-1).values for layer in kept]
