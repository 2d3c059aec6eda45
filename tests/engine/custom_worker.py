"""A user's own worker class, as ``--worker-cls tests.engine.custom_worker.MarkedCPUWorker`` names it."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker


class MarkedCPUWorker(CPUWorker):
    """Marks the worker in init_device, so a test can tell that this class (not vLLM's) ran."""

    def init_device(self) -> None:
        super().init_device()
        self.marked_by_user_class = True
