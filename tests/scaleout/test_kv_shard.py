"""``vllm_evict.kv_shard``: which KV heads a tensor-parallel rank holds, and, with more ranks than KV
heads, that every copy of a KV head scores exactly as one rank holding the whole query-head group.

The second test runs four real processes joined by a gloo process group on loopback (the collective
vLLM's TP group runs on CPU is the same kind of all-reduce): every policy spec, on three head layouts,
through the engine's paged score ops (shard_ranks.py). The engine tests (test_tp.py) check the same
end to end on two ranks; this one covers layouts two ranks cannot make (two KV heads with two copies
each, one KV head with four copies) in a few seconds.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

from tests.scaleout.shard_ranks import LAYOUTS, rank_main
from vllm_evict.engine.debug import global_kv_heads
from vllm_evict.kv_shard import KVShard

pytestmark = pytest.mark.tp


def _sum(t: torch.Tensor) -> torch.Tensor:
    raise AssertionError("no all-reduce expected")


@pytest.mark.parametrize("tp_size,total", [(1, 4), (2, 4), (4, 4), (2, 1), (4, 2), (8, 2), (4, 1)])
def test_shard_follows_vllm_sharding(tp_size, total):
    for rank in range(tp_size):
        shard = KVShard.of_rank(rank, tp_size, total, _sum)
        local = max(1, total // tp_size)
        assert list(range(shard.head_offset, shard.head_offset + shard.local_kv_heads)) == \
            global_kv_heads(rank, tp_size, total, local)
        assert shard.kv_replicas == max(1, tp_size // total)
        assert shard.replica == (rank % shard.kv_replicas)
    # Whole groups on every rank: nothing to complete, the all-reduce is never called.
    if tp_size <= total:
        partial = torch.rand(2, total // tp_size, 5)
        assert KVShard.of_rank(0, tp_size, total, _sum).complete_mass(partial) is partial


def test_shard_refuses_what_vllm_cannot_shard():
    with pytest.raises(ValueError, match="4 KV heads do not split over 3 tensor-parallel ranks"):
        KVShard.of_rank(0, 3, 4)
    with pytest.raises(ValueError, match="6 tensor-parallel ranks are not a multiple of 4 KV heads"):
        KVShard.of_rank(0, 6, 4)
    with pytest.raises(ValueError, match="replicated over ranks need the tensor-parallel group's all-reduce"):
        KVShard.of_rank(0, 2, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_policy_agrees_across_copies(tmp_path):
    world = 4
    torch.multiprocessing.spawn(rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for layout, (kv_heads, _) in LAYOUTS.items():
        per_rank = [report[layout] for report in reports]
        problems = [f"rank {r}: {p}" for r, rep in enumerate(per_rank) for p in rep["problems"]]
        assert not problems, f"{layout}:\n" + "\n".join(problems[:12])
        calls = {rep["all_reduces"] for rep in per_rank}
        assert len(calls) == 1, f"{layout}: ranks issued different numbers of all-reduces {calls} (a deadlock on GPU)"
        replicas = world // kv_heads if world > kv_heads else 1
        assert [rep["replicas"] for rep in per_rank] == [replicas] * world
        if replicas == 1:
            assert calls == {0}, f"{layout}: whole groups on every rank need no all-reduce for a group sum"
        else:
            assert calls.pop() > 0
        # TOVA ranks by the whole layer: its per-position totals are added over every rank.
        assert len({rep["layer_wide"] for rep in per_rank}) == 1 and per_rank[0]["layer_wide"] > 0
