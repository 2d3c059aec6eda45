"""The worker's per-config table stays as small as the set of requests it holds (engine/rows.py).

The request objects here carry only what ``RowTable.add`` reads of vLLM's CachedRequestState (``req_id``
and ``sampling_params.extra_args``); tests/engine/test_hostile_settings.py runs the same through the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_evict.config import ServerConfig
from vllm_evict.engine.rows import PolicyTable, RowTable
from vllm_evict.request_settings import carry, resolve, server_settings

SERVER = {"policy": "snapkv", "budget": 64, "request_policies": ["nacl"]}


@dataclass
class Params:
    extra_args: dict[str, Any] | None = None


@dataclass
class Request:
    req_id: str
    sampling_params: Params = field(default_factory=Params)


def request(request_id: str, **xargs: Any) -> Request:
    """A request as the worker gets it: with the canonical settings the scheduler accepted."""
    resolved = resolve(server_settings(SERVER), xargs, max_model_len=4096)
    return Request(request_id, Params(carry(xargs, resolved) if xargs else None))


def test_thousands_of_distinct_configs_leave_the_table_small():
    news = []
    table = PolicyTable()
    rows = RowTable(8, SERVER, table, on_new_policy=lambda config, policy: news.append(config))
    table.index_of(ServerConfig.from_mapping(SERVER).eviction)  # the server's own, pinned (as the runner does)
    version = table.version
    for wave in range(500):  # 4000 requests, 8 at a time, each with its own seed and budget
        ids = [f"r{wave}-{i}" for i in range(8)]
        for row, request_id in enumerate(ids):
            rows.add(row, request(request_id, kv_budget=40 + (wave * 8 + row) % 2000,
                                  kv_eviction_config={"seed": wave * 8 + row}))
        assert table.live() == 1 + 8 and len(table) <= 1 + 8
        for row, request_id in enumerate(ids):
            rows.park(request_id, row)
            rows.clear(row)
            rows.forget(request_id)
        rows.forgotten.clear()
        assert table.live() == 1
    assert len(table) == 9 and len(news) == 4000 and table.version == version + 4000
    assert not rows.policy_of and not rows.parked and not rows.slot_of


def test_requests_sharing_a_config_share_one_entry_until_the_last_one_ends():
    table = PolicyTable()
    rows = RowTable(4, SERVER, table)
    server_index = table.index_of(ServerConfig.from_mapping(SERVER).eviction)
    rows.add(0, request("a", kv_budget=100))
    rows.add(1, request("b", kv_budget=100))
    rows.add(2, request("c"))  # the server's own config
    rows.add(3, request("d", kv_eviction="none"))
    assert rows.policy[:4].tolist() == [rows.policy[0], rows.policy[0], server_index, -1]
    assert table.live() == 2 and table.users[rows.policy[0]] == 2
    rows.forget("a")
    assert table.live() == 2
    rows.forget("b")
    assert table.live() == 1 and table.users[server_index] == 2  # pinned + "c"
    index = int(rows.policy[0])
    rows.add(0, request("e", kv_eviction="nacl", kv_budget=4000))
    assert int(rows.policy[0]) == index  # the forgotten entry's index is reused ...
    assert table.configs[index].policy == "nacl" and table.policies[index].window_for(4000) == 32  # ... capped
