"""Fixtures for tests that run the real vLLM V1 engine on CPU, in process, on the model runner the suite
was started for (``VLLM_EVICT_TEST_RUNNER=v1|v2``, tests/conftest.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="the engine tests need vLLM (make install)")

from tests.engine.helpers import MULTIPROCESS_SERVER, TEST_RUNNER, Engine, make_llm, runner_kind  # noqa: E402
from vllm_evict.testing import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def engine_factory() -> Iterator[Any]:
    made: list[Engine] = []

    def factory(*args: Any, runner: str = TEST_RUNNER, **kwargs: Any) -> Engine:
        engine = Engine(make_llm(*args, **kwargs))
        made.append(engine)
        # The suite runs on the runner it was started for (VLLM_EVICT_TEST_RUNNER), or it tests nothing.
        assert runner_kind(engine.runner) == runner, f"vLLM built a {runner_kind(engine.runner)} runner, not {runner}"
        return engine

    yield factory
    for engine in made:
        engine.llm.llm_engine.engine_core.shutdown()
    made.clear()
    gc.collect()


# ---- vLLM's default multiprocess engine (engine core in its own process), started once for the suite ----
# One engine, two runs in order: a SnapKV request with vLLM's stats on (its stats and the engine's eviction
# metrics, read before anything else runs: tests/engine/test_stats.py), then two KeyDiff requests through a
# per-request override (their logprobs: tests/engine/test_lifecycle.py).
MULTIPROCESS_SCRIPT = textwrap.dedent("""
    import json, sys
    from tests.engine.helpers import make_llm, greedy, token_prompt, chosen_logprobs
    from vllm_evict.stats import eviction_stats
    if __name__ == "__main__":
        llm = make_llm(sys.argv[1], json.loads(sys.argv[2]), disable_log_stats=False)
        out = llm.generate([token_prompt(200, 3)], greedy(50))[0]
        metrics = {m.name + json.dumps(m.labels, sort_keys=True): getattr(m, "value", getattr(m, "count", None))
                   for m in llm.get_metrics() if "kv_eviction" in m.name}
        outs = llm.generate([token_prompt(200, 5), token_prompt(90, 6)], greedy(30, kv_eviction="keydiff"))
        print("RESULT" + json.dumps({"stats": eviction_stats(out).to_dict(), "metrics": metrics,
                                     "keydiff_logprobs": [chosen_logprobs(o) for o in outs]}))
""")


@pytest.fixture(scope="session")
def multiprocess_run(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What ``MULTIPROCESS_SCRIPT`` printed, run once with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``."""
    script = tmp_path_factory.mktemp("multiprocess") / "run.py"
    script.write_text(MULTIPROCESS_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(script), tiny_llama, json.dumps(MULTIPROCESS_SERVER)],
                            capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, result.stderr[-3000:]
    return json.loads(lines[0][len("RESULT"):])
