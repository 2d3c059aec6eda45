"""Workers that put EvictRunnerMixin in front of vLLM's V1 model runner.

The runner is built inside ``init_device``; its class is swapped right after, before the model or the
KV cache exist, so every later call goes through the mixin.
"""

from __future__ import annotations

from typing import Any

from vllm_evict.engine.runner import EvictRunnerMixin
from vllm_evict.engine.stats import WorkerReport, attach_worker_report

_RUNNER_CLASSES: dict[type, type] = {}


def install_runner_mixin(worker: Any) -> None:
    runner = worker.model_runner
    base = type(runner)
    if not hasattr(runner, "_update_states") or not hasattr(runner, "_prepare_inputs"):
        raise ValueError(f"KV eviction needs vLLM's V1 model runner, got {base.__name__}; "
                         "set VLLM_USE_V2_MODEL_RUNNER=0")
    if base not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[base] = type("Evict" + base.__name__, (EvictRunnerMixin, base), {})
    runner.__class__ = _RUNNER_CLASSES[base]
    runner.evict_init()


def report_step(worker: Any, output: Any) -> Any:
    """The step's output with the worker's eviction report (time spent evicting, requests with state),
    for the scheduler's metrics. vLLM returns the output from execute_model or, when that returns None,
    from sample_tokens; the time accumulates until an output carries it."""
    if output is None:
        return None
    runner = worker.model_runner
    report = WorkerReport(eviction_seconds=runner.evict_timer.take(),
                          tracked_requests=len(runner.evict_state.request_ids()))
    return attach_worker_report(output, report)


def _worker_class(base_path: str) -> type:
    module, name = base_path.rsplit(".", 1)
    base = getattr(__import__(module, fromlist=[name]), name)

    def init_device(self: Any) -> None:
        base.init_device(self)
        install_runner_mixin(self)

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        return report_step(self, base.execute_model(self, *args, **kwargs))

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        return report_step(self, base.sample_tokens(self, *args, **kwargs))

    return type("Evict" + name, (base,), {"init_device": init_device, "execute_model": execute_model,
                                          "sample_tokens": sample_tokens, "__module__": __name__})


def __getattr__(name: str) -> type:
    # Resolved lazily: importing the GPU worker on a CPU build (or the reverse) must not happen.
    targets = {"EvictCPUWorker": "vllm.v1.worker.cpu_worker.CPUWorker",
               "EvictGPUWorker": "vllm.v1.worker.gpu_worker.Worker"}
    if name not in targets:
        raise AttributeError(name)
    cls = _worker_class(targets[name])
    globals()[name] = cls
    return cls
