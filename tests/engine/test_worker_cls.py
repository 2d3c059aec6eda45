"""A user's ``--worker-cls`` runs with eviction: the plugin wraps it, it does not bypass the runner."""

from __future__ import annotations

import pytest

from tests.engine.custom_worker import MarkedCPUWorker
from tests.engine.helpers import greedy, token_prompt
from vllm_evict.engine.runner import EvictRunnerMixin

pytestmark = pytest.mark.engine


def test_user_worker_class_runs_with_the_eviction_runner(tiny_llama, engine_factory):
    budget = 64
    engine = engine_factory(tiny_llama, {"policy": "keydiff", "budget": budget},
                            worker_cls="tests.engine.custom_worker.MarkedCPUWorker")
    worker = engine.core.model_executor.driver_worker.worker
    assert isinstance(worker, MarkedCPUWorker) and worker.marked_by_user_class  # the user's class ran
    assert isinstance(engine.runner, EvictRunnerMixin)  # and the eviction runner is in place
    llm_engine = engine.llm.llm_engine
    llm_engine.add_request("r", token_prompt(300), greedy(40))
    cached, worker_evicted = [], []
    while llm_engine.has_unfinished_requests():
        llm_engine.step()
        for request_id in engine.scheduler.requests:
            cached.append(engine.scheduler.num_cached_tokens(request_id))
            row = engine.runner.evict_view.row_of(request_id)
            worker_evicted.append(int(engine.runner.evict_rows.evicted[row]) if row is not None else 0)
    # The worker compacted what the scheduler planned: both sides count the same evicted tokens.
    assert max(worker_evicted) > 0
    assert max(cached[1:]) <= budget + 64  # budget + one chunk (max_num_batched_tokens=64)
    assert engine.free_pages() == engine.total_pages()
