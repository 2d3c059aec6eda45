"""Workers that put EvictRunnerMixin in front of vLLM's V1 model runner.

The runner is built inside ``init_device``; its class is swapped right after, before the model or the
KV cache exist, so every later call goes through the mixin.
"""

from __future__ import annotations

from typing import Any

from vllm_evict.engine.runner import EvictRunnerMixin

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


def _worker_class(base_path: str) -> type:
    module, name = base_path.rsplit(".", 1)
    base = getattr(__import__(module, fromlist=[name]), name)

    def init_device(self: Any) -> None:
        base.init_device(self)
        install_runner_mixin(self)

    def determine_available_memory(self: Any) -> int:
        # Eviction's buffers live next to the KV cache: they come out of its memory, before vLLM sizes
        # the pool, so that eviction can never push the device out of memory.
        return self.model_runner.evict_kv_share(base.determine_available_memory(self))

    return type("Evict" + name, (base,), {"init_device": init_device, "__module__": __name__,
                                           "determine_available_memory": determine_available_memory})


def __getattr__(name: str) -> type:
    # Resolved lazily: importing the GPU worker on a CPU build (or the reverse) must not happen.
    targets = {"EvictCPUWorker": "vllm.v1.worker.cpu_worker.CPUWorker",
               "EvictGPUWorker": "vllm.v1.worker.gpu_worker.Worker"}
    if name not in targets:
        raise AttributeError(name)
    cls = _worker_class(targets[name])
    globals()[name] = cls
    return cls
