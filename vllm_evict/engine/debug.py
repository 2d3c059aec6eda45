"""Worker-side read-outs for tests and debugging, called on every worker with ``LLM.collective_rpc``.

vLLM runs a callable passed to ``collective_rpc`` on each worker (in process, in the multiprocess
executor's worker processes, or in Ray actors) with the worker as first argument and sends the return
value back pickled. The functions here only read the eviction runner's state (plus switching on its
``kept_record``), so the test process can see what every tensor-parallel rank kept, named by *global*
KV head.

    llm.collective_rpc(start_recording)
    llm.generate(...)
    ranks = llm.collective_rpc(kept_by_global_head)   # one RankKept per worker
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class RankKept:
    """What one worker kept: per request, per layer, the logical positions [H_local, n] in slot order."""

    tp_rank: int
    tp_size: int
    global_kv_heads: list[int]  # global KV head of each local head, in local order
    kept: dict[str, list[Tensor]]  # engine request id -> per layer [H_local, n]


def global_kv_heads(tp_rank: int, tp_size: int, total_kv_heads: int, local_kv_heads: int) -> list[int]:
    """Global KV head index of each local KV head, as vLLM's QKVParallelLinear shards them.

    With ``tp_size <= total_kv_heads`` rank r holds heads ``[r*local, (r+1)*local)``; with more ranks than
    heads each head is replicated on ``tp_size // total_kv_heads`` consecutive ranks, and rank r holds
    head ``r // replicas`` (vLLM: ``shard_rank = tp_rank // num_kv_head_replicas``)."""
    replicas = max(1, tp_size // total_kv_heads)
    first = (tp_rank // replicas) * local_kv_heads
    return list(range(first, first + local_kv_heads))


def _runner(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    if runner is None or getattr(runner, "evict_rows", None) is None:
        raise RuntimeError("this worker runs without KV eviction (no eviction rows on its model runner); "
                           "start the engine with kv_eviction in additional_config")
    return runner


def start_recording(worker: Any) -> None:
    """From now on the runner keeps the kept positions of every request that finishes."""
    _runner(worker).evict_kept_record = {}


def kept_by_global_head(worker: Any) -> RankKept:
    """Kept positions of every request this worker recorded as finished, plus those still resident.

    A finished request stays in the runner until the next step tells it so; the ones that finished in
    the last step before this call are read directly (their pages are still untouched)."""
    from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size)

    runner = _runner(worker)
    kept: dict[str, list[Tensor]] = dict(runner.evict_kept_record or {})
    rows = runner.evict_rows
    for request_id, row in runner.evict_view.held_rows().items():
        if request_id not in kept and rows.policy[row] >= 0:
            # its pages copied in the last step (prefix caching) reach the block table with the next one
            kept[request_id] = runner.kept_positions(request_id, runner.evict_relocations.get(request_id))
    tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    total = runner.model_config.get_total_num_kv_heads()
    local = runner.model_config.get_num_kv_heads(runner.parallel_config)
    return RankKept(tp_rank=tp_rank, tp_size=tp_size,
                    global_kv_heads=global_kv_heads(tp_rank, tp_size, total, local),
                    kept={request_id: [layer.cpu() for layer in layers] for request_id, layers in kept.items()})
