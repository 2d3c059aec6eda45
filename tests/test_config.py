"""EvictionConfig validation and per-request resolution: every bad input is a ValueError that says why."""

from __future__ import annotations

import json

import pytest

from vllm_evict.config import EvictionConfig, parse_spec, resolve_request_config
from vllm_evict.policies import BASE_POLICIES, META_POLICIES


def from_spec(spec, budget=256, **options):
    return EvictionConfig.from_spec(spec, budget, **options)


# ---- valid specs --------------------------------------------------------------------------------

def test_parse_and_normalise():
    assert parse_spec("snapkv") == (None, "snapkv")
    assert parse_spec(" CAOTE + SnapKV ") == ("caote", "snapkv")
    cfg = from_spec("Criticalkv+SNAPKV", 128, alpha=0.25, window=16, pooling="max")
    assert cfg.policy == "criticalkv+snapkv" and cfg.budget == 128
    policy = cfg.build_policy()
    assert policy.alpha == 0.25 and policy.epsilon == 1e-4
    assert policy.base.window == 16 and policy.base.pooling == "max" and policy.base.kernel == 7


def test_schedule_defaults_follow_the_method():
    assert from_spec("snapkv").schedule == "oneshot"
    assert from_spec("caote+snapkv").schedule == "oneshot"
    # H2O and TOVA as their releases: the prompt is processed, then cut to the budget once.
    assert from_spec("h2o").schedule == "oneshot"
    assert from_spec("fastcaote+h2o").schedule == "oneshot"
    assert from_spec("tova").schedule == "oneshot"
    # KeyDiff's paper processes the prompt block by block.
    assert from_spec("keydiff").schedule == "chunked"
    assert from_spec("caote+tova", schedule="chunked").schedule == "chunked"
    assert from_spec("snapkv", schedule="chunked").schedule == "chunked"


def test_round_trip():
    cfg = from_spec("caote+snapkv", 300, window=16, caote_mode="head", slack=32, seed=5)
    again = EvictionConfig.from_mapping(json.loads(str(cfg)))
    assert again == cfg
    assert EvictionConfig.from_mapping({"policy": "tova", "budget": 64}).policy == "tova"


def test_budget_just_above_protected_is_fine():
    assert from_spec("snapkv", 33).budget == 33  # window 32
    assert from_spec("streamingllm", 5).budget == 5  # 4 sinks


# ---- invalid specs --------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    ("snapkvv", r"unknown eviction policy 'snapkvv' in 'snapkvv'; bases: snapkv, h2o"),
    ("caote+snapkvv", r"unknown eviction policy 'snapkvv' in 'caote\+snapkvv'"),
    ("caote", r"caote is a meta score and needs a base, e.g. 'caote\+snapkv'"),
    ("criticalkv", r"criticalkv is a meta score and needs a base"),
    ("caote+criticalkv+snapkv", r"at most one meta score over one base"),
    ("snapkv+caote", r"at most one meta score over one base"),
    ("snapkv+h2o", r"snapkv is a base, not a meta score"),
    ("", r"unknown eviction policy ''"),
    (None, r"eviction policy must be a string"),
    (3, r"eviction policy must be a string"),
])
def test_bad_spec(spec, message):
    with pytest.raises(ValueError, match=message):
        from_spec(spec)


@pytest.mark.parametrize("spec,base", [
    ("caote+keydiff", "keydiff"), ("fastcaote+knorm", "knorm"),
    ("criticalkv+streamingllm", "streamingllm"), ("caote+random", "random"),
])
def test_meta_over_a_base_without_attention_mass(spec, base):
    meta = spec.split("+")[0]
    with pytest.raises(ValueError, match=rf"{meta} cannot wrap {base}: .*valid bases for {meta}: snapkv, h2o, tova"):
        from_spec(spec)


@pytest.mark.parametrize("budget,message", [
    (None, r"a KV budget is required"),
    (0, r"budget must be an integer >= 1, got 0"),
    (-5, r"budget must be an integer >= 1, got -5"),
    (64.0, r"budget must be an integer >= 1, got 64.0"),
    ("64", r"budget must be an integer >= 1, got '64'"),
    (True, r"budget must be an integer >= 1, got True"),
])
def test_bad_budget(budget, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig.from_spec("h2o", budget)


@pytest.mark.parametrize("spec,budget,options,message", [
    ("snapkv", 32, {}, r"budget 32 must be larger than the 32 tokens snapkv always keeps \(sinks 0 \+ window 32\)"),
    ("caote+snapkv", 20, {"window": 16, "sinks": 4}, r"the 20 tokens caote\+snapkv always keeps \(sinks 4 \+ window 16\)"),
    ("criticalkv+h2o", 8, {"recent": 8}, r"budget 8 must be larger than the 8 tokens criticalkv\+h2o always keeps"),
    ("streamingllm", 4, {}, r"budget 4 must be larger than the 4 tokens streamingllm always keeps \(sinks 4\)"),
])
def test_budget_not_above_protected(spec, budget, options, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig.from_spec(spec, budget, **options)


@pytest.mark.parametrize("spec,options,message", [
    ("snapkv", {"window": -1}, r"window must be an integer >= 1, got -1"),
    ("snapkv", {"window": 0}, r"window must be an integer >= 1, got 0"),
    ("snapkv", {"sinks": -2}, r"sinks must be an integer >= 0, got -2"),
    ("h2o", {"recent": -1}, r"recent must be an integer >= 0, got -1"),
    ("caote+tova", {"sinks": -1}, r"sinks must be an integer >= 0, got -1"),
    ("snapkv", {"kernel": 4}, r"kernel must be an odd positive integer"),
    ("criticalkv+snapkv", {"kernel": 0}, r"kernel must be an integer >= 1, got 0"),
    ("snapkv", {"pooling": "median"}, r"pooling must be one of avg, max, none; got 'median'"),
    ("snapkv", {"foo": 1}, r"unknown option 'foo' for snapkv; valid options: .*kernel.*window"),
    ("caote+snapkv", {"alpha": 0.5}, r"unknown option 'alpha' for caote\+snapkv; valid options: .*caote_mode"),
    ("criticalkv+h2o", {"window": 8}, r"unknown option 'window' for criticalkv\+h2o; valid options: .*epsilon"),
    ("snapkv", {"schedule": "eager"}, r"schedule must be one of chunked, oneshot; got 'eager'"),
    ("h2o", {"slack": 0}, r"slack must be an integer >= 1, got 0"),
    ("h2o", {"slack": -16}, r"slack must be an integer >= 1, got -16"),
    ("h2o", {"slack": "16"}, r"slack must be an integer >= 1, got '16'"),
    ("h2o", {"seed": -1}, r"seed must be an integer >= 0, got -1"),
])
def test_bad_options(spec, options, message):
    with pytest.raises(ValueError, match=message):
        from_spec(spec, **options)


@pytest.mark.parametrize("mapping,message", [
    (["snapkv"], r"eviction config must be a JSON object"),
    ({"budget": 64}, r"eviction config needs a 'policy'"),
    ({"policy": "snapkv"}, r"a KV budget is required"),
    ({"policy": "snapkv", "budget": 64, "cls": 1}, r"unknown option 'cls'"),
    ({"policy": "snapkv", "budget": 64, "spec": "h2o"}, r"unknown option 'spec'"),
    ({"policy": "snapkv", "budget": 64, 3: 1}, r"unknown option 3"),
])
def test_bad_mapping(mapping, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig.from_mapping(mapping)


def test_every_registered_name_parses():
    for base in BASE_POLICIES:
        assert parse_spec(base) == (None, base)
        for meta in META_POLICIES:
            assert parse_spec(f"{meta}+{base}") == (meta, base)


# ---- per-request overrides ------------------------------------------------------------------------

SERVER = {"policy": "snapkv", "budget": 1024, "window": 16, "seed": 3, "slack": 64}


def test_request_without_overrides_uses_the_server_config():
    assert resolve_request_config(None, None) is None
    assert resolve_request_config(None, {"unrelated": 1}) is None
    cfg = resolve_request_config(SERVER, {"temperature_hint": 0})
    assert cfg == EvictionConfig.from_mapping(SERVER)


@pytest.mark.parametrize("budget", [128, 4096])
def test_request_lowers_or_raises_the_budget(budget):
    cfg = resolve_request_config(SERVER, {"kv_budget": budget})
    assert cfg.budget == budget and cfg.policy == "snapkv" and cfg.options["window"] == 16
    assert cfg.seed == 3 and cfg.slack == 64


def test_request_picks_another_policy():
    cfg = resolve_request_config(SERVER, {"kv_eviction": "keydiff"})
    # snapkv's window does not apply to keydiff; budget and engine knobs stay; keydiff's own schedule default.
    assert cfg.policy == "keydiff" and cfg.budget == 1024 and cfg.seed == 3 and cfg.slack == 64
    assert "window" not in cfg.options and cfg.schedule == "chunked"
    cfg = resolve_request_config(SERVER, {"kv_eviction": "criticalkv+snapkv", "kv_budget": 512,
                                          "kv_eviction_config": {"alpha": 0.25, "window": 8}})
    assert cfg.policy == "criticalkv+snapkv" and cfg.budget == 512
    assert cfg.options == {"alpha": 0.25, "window": 8}
    # The same method spelled differently keeps the server's options.
    cfg = resolve_request_config(SERVER, {"kv_eviction": " SnapKV ", "kv_eviction_config": {"kernel": 5}})
    assert cfg.options == {"window": 16, "kernel": 5}


@pytest.mark.parametrize("value", ["none", "off", "", " None "])
def test_request_turns_eviction_off(value):
    assert resolve_request_config(SERVER, {"kv_eviction": value}) is None
    assert resolve_request_config(None, {"kv_eviction": value}) is None  # already off


@pytest.mark.parametrize("extra,message", [
    ({"kv_eviction": "none", "kv_budget": 64}, r"kv_eviction 'none' turns eviction off for this request"),
    ({"kv_budget": 0}, r"invalid per-request KV eviction settings: budget must be an integer >= 1, got 0"),
    ({"kv_budget": "lots"}, r"invalid per-request KV eviction settings: budget must be an integer"),
    ({"kv_budget": 16}, r"invalid per-request KV eviction settings: budget 16 must be larger than the 16"),
    ({"kv_eviction": "nope"}, r"invalid per-request KV eviction settings: unknown eviction policy 'nope'"),
    ({"kv_eviction": None}, r"invalid per-request KV eviction settings: eviction policy must be a string"),
    ({"kv_eviction": "caote"}, r"invalid per-request KV eviction settings: caote is a meta score"),
    ({"kv_eviction": "caote+keydiff"}, r"invalid per-request KV eviction settings: caote cannot wrap keydiff"),
    ({"kv_eviction_config": [1]}, r"kv_eviction_config must be a JSON object"),
    ({"kv_eviction_config": {"window": -2}}, r"invalid per-request KV eviction settings: window must be"),
    ({"kv_eviction_config": {"bogus": 1}}, r"invalid per-request KV eviction settings: unknown option 'bogus'"),
    ({"kv_eviction_config": {"schedule": "later"}}, r"schedule must be one of chunked, oneshot"),
])
def test_bad_request_values(extra, message):
    with pytest.raises(ValueError, match=message):
        resolve_request_config(SERVER, extra)


@pytest.mark.parametrize("extra", [{"kv_budget": 256}, {"kv_eviction": "h2o"},
                                   {"kv_eviction_config": {"window": 8}}])
def test_request_overrides_on_a_server_without_eviction(extra):
    with pytest.raises(ValueError, match=r"this server runs without KV eviction.*--kv-eviction POLICY"):
        resolve_request_config(None, extra)


def test_request_options_may_arrive_as_json_text():
    from vllm_evict.config import resolve_request_config

    config = resolve_request_config({"policy": "snapkv", "budget": 64}, {"kv_eviction_config": '{"window": 16}'})
    assert config.options["window"] == 16
    with pytest.raises(ValueError, match=r"kv_eviction_config must be a JSON object, got '\{window'"):
        resolve_request_config({"policy": "snapkv", "budget": 64}, {"kv_eviction_config": "{window"})
