"""What a server reserves at start-up (``ServerConfig`` -> ``Reservation``) and which requests it refuses."""

from __future__ import annotations

import pytest

from vllm_evict.config import DEFAULT_MIN_WINDOW, MAX_WINDOW, EvictionConfig, ServerConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
from vllm_evict.policies.nacl import NaCl
from vllm_evict.reservation import SERVER_OPTIONS, Reservation, refusal, server_reservation


def server(mapping: dict) -> ServerConfig:
    return ServerConfig.from_mapping(mapping)


def config(spec: str, budget: int = 256, **options) -> EvictionConfig:
    return EvictionConfig.from_spec(spec, budget, **options)


# ---- ServerConfig ------------------------------------------------------------------------------------
def test_server_options_are_not_eviction_options():
    mapping = {"policy": "snapkv", "budget": 256, "max_window": 64, "request_policies": ["h2o"]}
    assert set(SERVER_OPTIONS) == {"max_window", "request_policies"}
    assert EvictionConfig.from_mapping(mapping) == EvictionConfig.from_spec("snapkv", 256)
    got = server(mapping)
    assert got.eviction == EvictionConfig.from_spec("snapkv", 256)
    assert got.max_window == 64 and got.request_policies == ("h2o",)
    assert ServerConfig.from_mapping(got.to_dict()) == got


@pytest.mark.parametrize("mapping,ring", [
    ({"policy": "snapkv", "budget": 256}, False),  # fixed mode: windows are accumulated, or wait in lent pages
    ({"policy": "snapkv", "budget": 256, "mode": "elastic"}, True),  # elastic requests always need it
    ({"policy": "keydiff", "budget": 256, "mode": "elastic"}, True),  # for requests' windows (max_window)
])
def test_the_query_ring_is_reserved_on_elastic_servers_only(mapping, ring):
    got = server(mapping)
    assert got.ring == ring
    assert server_reservation(got).ring == ring


@pytest.mark.parametrize("mapping,max_window", [
    ({"policy": "keydiff", "budget": 256}, DEFAULT_MIN_WINDOW),  # no window: the minimum
    ({"policy": "snapkv", "budget": 256}, 32),
    ({"policy": "snapkv", "budget": 256, "window": 64}, 64),
    ({"policy": "caote+snapkv", "budget": 256, "window": 48}, 48),
    ({"policy": "ahakv", "budget": 256, "recent": 40}, 40),
    ({"policy": "nacl", "budget": 256}, NaCl.DEFAULT_PROXY),  # the default proxy count
    ({"policy": "nacl", "budget": 40}, DEFAULT_MIN_WINDOW),  # capped at (40 - 4) // 2 = 18 by the budget
    ({"policy": "nacl", "budget": 256, "proxy": 8}, DEFAULT_MIN_WINDOW),
    ({"policy": "h2o", "budget": 256, "recent": 100}, 100),  # its own options always fit
])
def test_default_max_window_covers_the_servers_own_method(mapping, max_window):
    got = server(mapping)
    assert got.max_window == max_window
    assert refusal(got.eviction, server_reservation(got)) is None


@pytest.mark.parametrize("mapping,message", [
    ({"policy": "snapkv", "budget": 256, "max_window": 16},
     r"max_window 16 is narrower than the server's own query window at budget 256 \(32\); raise max_window"),
    ({"policy": "snapkv", "budget": 256, "max_window": 0}, rf"max_window must be an integer in \[1, {MAX_WINDOW}\], got 0"),
    ({"policy": "snapkv", "budget": 256, "max_window": MAX_WINDOW + 1}, r"max_window must be an integer in"),
    ({"policy": "snapkv", "budget": 256, "max_window": "64"}, r"max_window must be an integer in .*got '64'"),
    ({"policy": "snapkv", "budget": 256, "max_window": 64.0}, r"max_window must be an integer in .*got 64.0"),
    ({"policy": "snapkv", "budget": 256, "request_policies": "h2o"}, r"request_policies must be a list"),
    ({"policy": "snapkv", "budget": 256, "request_policies": ["h2o", "nope"]},
     r"request_policies: unknown eviction policy 'nope'"),
    ({"policy": "snapkv", "budget": 256, "request_policies": ["caote+keydiff"]},
     r"request_policies: caote cannot wrap keydiff"),
    ({"policy": "snapkv", "budget": 256, "request_policies": [["h2o"]]},
     r"request_policies: eviction policy must be a string"),
    ({"policy": "snapkv", "budget": 8000, "window": 5000}, r"wider than the largest max_window, 4096"),
    ({"policy": "snapkv", "budget": 256, "window_ring": True},
     r"^window_ring was removed: a request inside a decode window now keeps its window's queries in free pages "
     r"of the KV pool by default \(docs/engine.md#observation-windows\); drop the option$"),
])
def test_bad_server_options(mapping, message):
    with pytest.raises(ValueError, match=message):
        server(mapping)


def test_explicit_max_window_caps_nacls_default_proxy_count():
    got = server({"policy": "nacl", "budget": 4096, "max_window": 16})
    assert got.max_window == 16
    policy = got.eviction.build_policy(window_cap=got.max_window)
    assert policy.window_for(4096) == 16 and policy.protected_count(4096) == 4 + 16
    assert got.eviction.build_policy().window_for(4096) == NaCl.DEFAULT_PROXY  # uncapped elsewhere


# ---- Reservation ------------------------------------------------------------------------------------
def policy_states(spec: str) -> set[str]:
    meta, _, base = spec.rpartition("+")
    names = set(load_class(base).state_names)
    return names | set(load_class(meta).state_names) if meta else names


def test_reservation_is_the_union_of_the_servers_and_request_policies_needs():
    got = server_reservation(server({"policy": "caote+snapkv", "budget": 256,
                                     "request_policies": ["h2o", "criticalkv+ahakv"]}))
    expected = policy_states("caote+snapkv") | policy_states("h2o") | policy_states("criticalkv+ahakv")
    assert got.states == frozenset(expected)
    assert {"acc", "nu", "vnorm", "score"} <= got.states
    assert got.o_proj and not got.ring and got.max_window == 32
    plain = server_reservation(server({"policy": "keydiff", "budget": 256}))
    assert plain == Reservation(states=frozenset(policy_states("keydiff")), head_states=frozenset(), max_window=32,
                                ring=False, o_proj=False, elastic=False)
    assert server_reservation(server({"policy": "snapkv", "budget": 256, "mode": "elastic"})).ring


def test_reservation_reads_head_states_where_a_policy_declares_them(monkeypatch):
    monkeypatch.setattr(load_class("tova"), "head_state_names", ("heads_state",), raising=False)
    got = server_reservation(server({"policy": "keydiff", "budget": 256, "request_policies": ["tova"]}))
    assert got.head_states == frozenset({"heads_state"})
    assert refusal(config("tova"), got) is None
    bare = server_reservation(server({"policy": "keydiff", "budget": 256}))
    assert "per-query-head token state 'heads_state'" in refusal(config("tova"), bare)


@pytest.mark.parametrize("spec", [*BASE_POLICIES, *(f"{m}+snapkv" for m in META_POLICIES)])
def test_every_method_is_served_once_listed_in_request_policies(spec):
    reservation = server_reservation(server({"policy": "keydiff", "budget": 256, "request_policies": [spec]}))
    assert refusal(config(spec), reservation) is None


def test_a_method_whose_needs_the_server_covers_needs_no_listing():
    reservation = server_reservation(server({"policy": "caote+snapkv", "budget": 256}))
    for spec in ("snapkv", "keydiff", "knorm", "random", "streamingllm", "tova", "fastcaote+snapkv", "caote+tova"):
        assert refusal(config(spec), reservation) is None, spec


@pytest.mark.parametrize("spec,state", [("h2o", "acc"), ("ahakv", "vnorm"), ("caote+h2o", "acc")])
def test_a_state_the_server_did_not_reserve_is_refused(spec, state):
    reservation = server_reservation(server({"policy": "snapkv", "budget": 256}))
    message = refusal(config(spec), reservation)
    assert message == (f"{spec} needs the per-token state '{state}', which this server did not reserve at start-up; "
                       f"add '{spec}' to the server's request_policies (--kv-eviction-config "
                       f"'{{\"request_policies\": [\"{spec}\"]}}'), or choose another method")


def test_criticalkv_needs_the_output_projections_loaded_at_start_up():
    reservation = server_reservation(server({"policy": "snapkv", "budget": 256}))
    message = refusal(config("criticalkv+snapkv"), reservation)
    assert message.startswith("criticalkv+snapkv needs each attention layer's output projection (o_proj), which "
                              "this server did not load at start-up; add 'criticalkv+snapkv' to the server's "
                              "request_policies")
    covered = server_reservation(server({"policy": "criticalkv+snapkv", "budget": 256}))
    assert covered.o_proj and refusal(config("criticalkv+tova"), covered) is None


@pytest.mark.parametrize("spec,options,what,width", [
    ("snapkv", {"window": 64}, "query window at budget 256", 64),
    ("caote+snapkv", {"window": 48}, "query window at budget 256", 48),
    ("ahakv", {"recent": 40}, "query window at budget 256", 40),
    ("nacl", {"proxy": 33}, "query window at budget 256", 33),
    ("keydiff", {"recent": 50}, "recent", 50),
])
def test_a_window_wider_than_max_window_is_refused(spec, options, what, width):
    reservation = server_reservation(server({"policy": "caote+snapkv", "budget": 256,
                                             "request_policies": ["ahakv"]}))
    assert reservation.max_window == 32
    message = refusal(config(spec, **options), reservation)
    assert message == (f"{what} must be at most the server's max_window, 32 queries, got {width}; lower it, or start "
                       f"the server with a larger max_window (--kv-eviction-config '{{\"max_window\": {width}}}')")
    assert refusal(config(spec, **{k: 32 for k in options}), reservation) is None


def test_nacls_automatic_proxy_rule_is_capped_not_refused():
    reservation = server_reservation(server({"policy": "snapkv", "budget": 256}))
    assert refusal(config("nacl", 4096), reservation) is None  # the rule's 1024 queries become 32


def test_elastic_requests_need_an_elastic_server():
    message = ("mode 'elastic' needs a server started in elastic mode, and this server's mode is 'fixed'; drop mode "
               "from the request, or start the server with --kv-eviction-config '{\"mode\": \"elastic\"}'")
    fixed = server_reservation(server({"policy": "snapkv", "budget": 256}))
    assert refusal(config("snapkv", mode="elastic"), fixed) == message
    elastic = server_reservation(server({"policy": "snapkv", "budget": 256, "mode": "elastic"}))
    assert refusal(config("snapkv", mode="elastic"), elastic) is None
    assert refusal(config("snapkv"), elastic) is None  # a fixed request on an elastic server
