"""Per-request settings (``vllm_evict.request_settings``): what a request may set, how it is refused, and the
canonical form that travels to the engine. No vLLM here: this is the front end's and the engine intake's
shared logic; tests/engine/test_hostile_settings.py runs the same through the real engine."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_evict.config import MAX_CONFIG_CHARS, EvictionConfig, ServerConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES
from vllm_evict.policies.options import MAX_SEED, MAX_TOKENS
from vllm_evict.request_settings import (NOT_RESERVED, OFF, REQUEST_KEYS, RESOLVED_KEY, RequestRefused, carry,
                                         config_of_extra_args, resolve, resolve_request_config, server_settings)

SERVER = {"policy": "snapkv", "budget": 1024, "window": 16, "seed": 3, "slack": 64,
          "request_policies": ["h2o", "criticalkv+snapkv"]}
MAX_MODEL_LEN = 4096
PREFIX = "invalid per-request KV eviction settings: "


def settle(extra, server=SERVER, max_model_len=MAX_MODEL_LEN):
    return resolve(server_settings(server), extra, max_model_len=max_model_len)


def refused(extra, server=SERVER, max_model_len=MAX_MODEL_LEN) -> RequestRefused:
    with pytest.raises(RequestRefused) as info:
        settle(extra, server, max_model_len)
    return info.value


# ---- what a request may change -------------------------------------------------------------------
def test_request_without_overrides_uses_the_server_config():
    assert resolve_request_config(None, None) is None
    assert resolve_request_config(None, {"unrelated": 1}) is None
    assert settle({"temperature_hint": 0}).config == ServerConfig.from_mapping(SERVER).eviction
    assert settle({"temperature_hint": 0}).canonical is None  # nothing to carry: the server's own


@pytest.mark.parametrize("budget", [128, MAX_MODEL_LEN])
def test_request_lowers_or_raises_the_budget(budget):
    cfg = settle({"kv_budget": budget}).config
    assert cfg.budget == budget and cfg.policy == "snapkv" and cfg.options["window"] == 16
    assert cfg.seed == 3 and cfg.slack == 64


def test_request_picks_another_policy():
    cfg = settle({"kv_eviction": "keydiff"}).config
    # snapkv's window does not apply to keydiff; budget and engine knobs stay; keydiff's own schedule default.
    assert cfg.policy == "keydiff" and cfg.budget == 1024 and cfg.seed == 3 and cfg.slack == 64
    assert "window" not in cfg.options and cfg.schedule == "chunked"
    cfg = settle({"kv_eviction": "criticalkv+snapkv", "kv_budget": 512,
                  "kv_eviction_config": {"alpha": 0.25, "window": 8}}).config
    assert cfg.policy == "criticalkv+snapkv" and cfg.budget == 512
    assert cfg.options == {"alpha": 0.25, "window": 8}
    # The same method spelled differently keeps the server's options.
    cfg = settle({"kv_eviction": " SnapKV ", "kv_eviction_config": {"kernel": 5}}).config
    assert cfg.options == {"window": 16, "kernel": 5}


@pytest.mark.parametrize("value", ["none", "off", "", " None "])
def test_request_turns_eviction_off(value):
    got = settle({"kv_eviction": value})
    assert got.config is None and got.canonical == OFF
    assert resolve_request_config(None, {"kv_eviction": value}) is None  # already off


def test_request_options_may_arrive_as_json_text():
    assert settle({"kv_eviction_config": '{"window": 8, "seed": 9223372036854775807}'}).config.options["window"] == 8


# ---- the canonical form ----------------------------------------------------------------------------
@pytest.mark.parametrize("extra", [
    {"kv_budget": 200}, {"kv_eviction": "h2o", "kv_eviction_config": '{"recent": 8, "slack": 16}'},
    {"kv_eviction": "none"}, {"kv_eviction": "criticalkv+snapkv", "kv_eviction_config": {"alpha": 0.3}},
])
def test_the_canonical_form_is_plain_data_that_resolves_to_the_same_config(extra):
    first = settle({**extra, "other_plugin": [1, 2]})
    carried = carry({**extra, "other_plugin": [1, 2]}, first)
    assert set(carried) == {"other_plugin", RESOLVED_KEY}  # the request's own keys are gone
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(carried))  # what vLLM sends to the engine core
    again = settle(wire)
    assert again.config == first.config and again.canonical == first.canonical
    assert config_of_extra_args(ServerConfig.from_mapping(SERVER).eviction, wire) == first.config  # the worker
    assert config_of_extra_args(ServerConfig.from_mapping(SERVER).eviction, {"other_plugin": 1}) == \
        ServerConfig.from_mapping(SERVER).eviction


@pytest.mark.parametrize("canonical,message", [
    ("snapkv", rf"{RESOLVED_KEY} must be an object, got 'snapkv'"),
    ({"policy": "snapkv", "budget": 10**30}, r"budget must be an integer in \[1, 2147483647\]"),
    ({"policy": "snapkv", "budget": 100000}, r"budget must be an integer in \[1, 4096\], got 100000"),
    ({"policy": "snapkv", "budget": 256, "max_window": 4096}, rf"{RESOLVED_KEY} may not set server options"),
    ({"policy": "snapkv", "budget": 256, "window": 64}, r"query window at budget 256 must be at most the server's "
                                                        r"max_window, 32 queries, got 64"),
    ({"policy": "ahakv", "budget": 256}, r"ahakv needs the per-token state 'vnorm'"),
    ({"policy": "none", "budget": 5}, r"unknown eviction policy 'none'"),
])
def test_a_canonical_form_from_a_client_is_validated_like_anything_else(canonical, message):
    assert PREFIX in str(refused({RESOLVED_KEY: canonical}))
    with pytest.raises(RequestRefused, match=message):
        settle({RESOLVED_KEY: canonical})


def test_the_request_keys_win_over_a_canonical_form_sent_alongside():
    got = settle({"kv_budget": 300, RESOLVED_KEY: {"policy": "keydiff", "budget": 100}})
    assert got.config.policy == "snapkv" and got.config.budget == 300


# ---- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,message", [
    ({"kv_eviction": "none", "kv_budget": 64}, r"kv_eviction 'none' turns eviction off for this request"),
    ({"kv_budget": 0}, rf"^{PREFIX}kv_budget must be an integer in \[1, 4096\], got 0$"),
    ({"kv_budget": "lots"}, rf"{PREFIX}kv_budget must be an integer in \[1, 4096\], got 'lots'"),
    ({"kv_budget": 4097}, rf"{PREFIX}kv_budget must be an integer in \[1, 4096\], got 4097"),
    ({"kv_budget": 2**64}, r"kv_budget must be an integer in \[1, 4096\], got 18446744073709551616"),
    ({"kv_budget": 12.0}, r"kv_budget must be an integer in \[1, 4096\], got 12.0"),
    ({"kv_budget": True}, r"kv_budget must be an integer in \[1, 4096\], got True"),
    ({"kv_budget": 16}, rf"{PREFIX}budget 16 must be larger than the 16"),
    ({"kv_eviction": "nope"}, rf"{PREFIX}unknown eviction policy 'nope'"),
    ({"kv_eviction": None}, rf"{PREFIX}kv_eviction must be a method such as 'snapkv' or 'none', got None"),
    ({"kv_eviction": ["snapkv"]}, r"kv_eviction must be a method .*got a list of 1 entries"),
    ({"kv_eviction": "caote"}, rf"{PREFIX}caote is a meta score"),
    ({"kv_eviction": "caote+keydiff"}, rf"{PREFIX}caote cannot wrap keydiff"),
    ({"kv_eviction_config": [1]}, r"kv_eviction_config must be a JSON object, got a list of 1 entries"),
    ({"kv_eviction_config": {"window": -2}}, rf"{PREFIX}window must be an integer in \[1, 2147483647\], got -2"),
    ({"kv_eviction_config": {"bogus": 1}}, rf"{PREFIX}unknown option 'bogus' for snapkv; valid options: budget, kernel"),
    ({"kv_eviction_config": {"schedule": "later"}}, r"schedule must be one of chunked, oneshot"),
    ({"kv_eviction_config": {"max_window": 4096}}, r"kv_eviction_config: max_window is a server option"),
    ({"kv_eviction_config": {"request_policies": ["ahakv"]}}, r"kv_eviction_config: request_policies is a server"),
    ({"kv_eviction_config": {"window_ring": True}}, rf"{PREFIX}unknown option 'window_ring' for snapkv"),
    ({"kv_eviction_config": {"budget": 100}}, r"kv_eviction_config: set the budget with kv_budget, not with budget"),
    ({"kv_eviction_config": {"policy": "h2o"}}, r"kv_eviction_config: set the method with kv_eviction"),
    ({"kv_eviction_config": {"slack": 5000}}, r"slack must be an integer in \[1, 4096\], got 5000"),
    ({"kv_eviction_config": {"seed": 2**63}}, r"seed must be an integer in \[0, 9223372036854775807\]"),
    ({"kv_eviction_config": {"mode": "elastic"}}, r"mode 'elastic' needs a server started in elastic mode"),
    ({"kv_eviction_config": {3: 1}}, r"kv_eviction_config: option names are strings, got 3"),
    ({"kv_evictoin": "h2o"}, rf"^{PREFIX}unknown key 'kv_evictoin'; the eviction keys are kv_eviction, kv_budget, "
                             r"kv_eviction_config$"),
    ({"kv_budgets": 64}, r"unknown key 'kv_budgets'"),
])
def test_bad_request_values(extra, message):
    with pytest.raises(RequestRefused, match=message):
        settle(extra)


@pytest.mark.parametrize("text,message", [
    ('{"window": 8, "window": 9}', r"kv_eviction_config has the key 'window' twice"),
    ('{"temperature": NaN}', r"kv_eviction_config: NaN is not a number here; numbers must be finite"),
    ('{"temperature": Infinity}', r"kv_eviction_config: Infinity is not a number here"),
    ('{"temperature": -Infinity}', r"kv_eviction_config: -Infinity is not a number here"),
    ('{"window": 1e999}', r"window must be an integer in \[1, 2147483647\], got inf"),
    ('{"window": 1e3}', r"window must be an integer in \[1, 2147483647\], got 1000.0"),
    ('{"window": {"a": 1}}', r"window must be an integer in \[1, 2147483647\], got a JSON object of 1 entries"),
    ('{"pooling": [1, [2]]}', r"pooling must be one of avg, max, none; got a list of 2 entries"),
    ('[' * 2000 + ']' * 2000, r"kv_eviction_config is nested too deeply"),
    ('{"a":' * 600 + '1' + '}' * 600, r"unknown option 'a' for snapkv"),
    ('{"window": 8', r"kv_eviction_config must be a JSON object, got '\{\"window\": 8' \(Expecting ',' delimiter"),
    ('"window"', r"kv_eviction_config must be a JSON object, got '\"window\"'$"),
    ('{"w": "' + "x" * (MAX_CONFIG_CHARS + 1) + '"}', r"kv_eviction_config must be a JSON object of at most 4096 "
                                                       r"characters, got 4106$"),
    ('{"' + "k" * 3000 + '": 1}', r"unknown option 'k{64}'\.\.\. \(3000 characters\) for snapkv"),
    ('{"window": ' + "9" * 4000 + '}', r"window must be an integer in \[1, 2147483647\], got an integer of 13288 bits"),
])
def test_hostile_json_is_refused_with_a_short_message(text, message):
    err = refused({"kv_eviction_config": text})
    assert len(str(err)) < 500
    with pytest.raises(RequestRefused, match=message):
        settle({"kv_eviction_config": text})


def test_what_the_server_did_not_reserve_is_refused_under_its_own_reason():
    err = refused({"kv_eviction": "ahakv"})
    assert err.reason == NOT_RESERVED
    assert str(err) == (f"{PREFIX}ahakv needs the per-token state 'vnorm', which this server did not reserve at "
                        "start-up; add 'ahakv' to the server's request_policies (--kv-eviction-config "
                        "'{\"request_policies\": [\"ahakv\"]}'), or choose another method")
    assert refused({"kv_eviction_config": {"window": 64}}).reason == NOT_RESERVED
    assert refused({"kv_budget": 0}).reason == "invalid_settings"


def test_nacl_with_a_large_budget_is_capped_to_max_window_not_refused():
    cfg = settle({"kv_eviction": "nacl", "kv_budget": 4000}).config
    assert cfg.policy == "nacl" and cfg.build_policy(window_cap=32).window_for(4000) == 32


@pytest.mark.parametrize("extra", [{"kv_budget": 256}, {"kv_eviction": "h2o"}, {"kv_eviction_config": {"window": 8}},
                                   {RESOLVED_KEY: {"policy": "snapkv", "budget": 64}}])
def test_request_overrides_on_a_server_without_eviction(extra):
    with pytest.raises(RequestRefused, match=r"this server runs without KV eviction.*--kv-eviction POLICY"):
        settle(extra, server=None)


def test_a_server_budget_above_max_model_len_stays_usable():
    """A server may run a budget above max_model_len (it then never evicts); its requests inherit it."""
    roomy = {"policy": "snapkv", "budget": 8192}
    got = settle({"kv_eviction_config": {"kernel": 5}}, server=roomy)
    assert got.config.budget == 8192 and settle(carry({}, got), server=roomy).config == got.config
    assert settle({"kv_budget": 8192}, server=roomy).config.budget == 8192
    with pytest.raises(RequestRefused, match=r"kv_budget must be an integer in \[1, 8192\]"):
        settle({"kv_budget": 8193}, server=roomy)


# ---- property: whatever a client sends, a config within every bound or a short RequestRefused ----------
SPECS = [*BASE_POLICIES, *(f"{m}+{b}" for m in META_POLICIES for b in BASE_POLICIES)]
OPTION_NAMES = ["window", "kernel", "pooling", "sinks", "recent", "proxy", "random_ratio", "temperature", "heads",
                "value_kernel", "caote_mode", "eps", "alpha", "epsilon", "schedule", "slack", "seed", "mode",
                "budget", "policy", "max_window", "request_policies", "window_ring", "bogus"]  # window_ring: removed
HOSTILE_INTS = [0, -1, 1, 2, 31, 33, 64, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 134217729]
scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from(HOSTILE_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["avg", "max", "none", "layer", "group", "head", "chunked", "oneshot", "fixed", "elastic", ""]),
    st.text(max_size=8), st.just("x" * 5000))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                          max_size=3), max_leaves=6)
option_dicts = st.dictionaries(st.sampled_from(OPTION_NAMES) | st.text(max_size=6), values, max_size=4)


def json_text(options: dict) -> str:
    return json.dumps(options, allow_nan=True, default=str)


config_values = st.one_of(option_dicts, option_dicts.map(json_text), values,
                          st.sampled_from(['{"window": 8, "window": 8}', '{"eps": NaN}', "[" * 3000, "{" * 900,
                                           '{"seed": 18446744073709551616}', '{"kernel": 134217729}']))
extra_args = st.fixed_dictionaries({}, optional={
    "kv_eviction": st.one_of(st.sampled_from([*SPECS, "none", "off", "", "nope", "caote", "snapkv+h2o"]), values),
    "kv_budget": st.one_of(st.integers(min_value=-10, max_value=6000), st.sampled_from(HOSTILE_INTS), values),
    "kv_eviction_config": config_values,
    RESOLVED_KEY: st.one_of(option_dicts, st.just(OFF), values),
    "kv_evict": values, "other": st.text(max_size=8)})
servers = st.sampled_from([SERVER, {"policy": "keydiff", "budget": 256},
                           {"policy": "caote+snapkv", "budget": 256, "mode": "elastic", "max_window": 64,
                            "request_policies": [*BASE_POLICIES, "criticalkv+snapkv"]}])


def check_bounded(config: EvictionConfig, server: ServerConfig, max_model_len: int) -> None:
    limit = max(max_model_len, server.eviction.budget, server.eviction.slack or 0)
    assert 1 <= config.budget <= limit and 0 <= config.seed <= MAX_SEED
    assert config.slack is None or 1 <= config.slack <= limit
    for value in config.options.values():
        assert value is None or isinstance(value, (str, int, float)), value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert math.isfinite(value) and abs(value) <= MAX_TOKENS, value
    policy = config.build_policy(window_cap=server.max_window)
    assert policy.window_for(config.budget) <= server.max_window


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(server=servers, extra=extra_args, max_model_len=st.sampled_from([64, 4096]))
def test_any_settings_resolve_within_bounds_or_are_refused_clearly(server, extra, max_model_len):
    settings_ = server_settings(server)
    try:
        got = resolve(settings_, extra, max_model_len=max_model_len)
    except RequestRefused as err:
        message = str(err)
        assert 0 < len(message) < 700, message
        named = [*REQUEST_KEYS, RESOLVED_KEY, "unknown key", "budget", "eviction policy", "meta score", "cannot wrap",
                 "server", *OPTION_NAMES, "option"]
        assert any(name in message for name in named), message
        return
    if got.config is not None:
        check_bounded(got.config, settings_[0], max_model_len)
    if got.canonical is not None:  # what travels to the engine encodes, and resolves there to the same
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(carry(extra, got)))
        assert resolve(settings_, wire, max_model_len=max_model_len).config == got.config
