"""EvictionConfig validation and per-request resolution: every bad input is a ValueError that says why."""

from __future__ import annotations

import json

import pytest

from vllm_evict.config import EvictionConfig, parse_spec
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


@pytest.mark.parametrize("spec,budget,options,page,slack", [
    # Methods that read a window of queries at decode evictions: 4 windows, at most half the budget, in pages.
    ("snapkv", 2048, {}, 16, 128),
    ("snapkv", 256, {}, 32, 128),
    ("snapkv", 256, {"window": 8}, 16, 32),
    ("snapkv", 256, {"window": 10}, 16, 48),  # 40 tokens, rounded up to whole pages
    ("snapkv", 64, {}, 16, 32),  # half the budget
    ("snapkv", 40, {"window": 8}, 16, 32),  # 20 tokens, in pages
    ("snapkv", 24, {"window": 8}, 32, 32),  # never less than one page
    ("caote+snapkv", 1024, {}, 16, 128),
    ("criticalkv+snapkv", 1024, {}, 16, 128),
    ("nacl", 1024, {"proxy": 64}, 16, 256),
    # Methods without a decode window (or a one-query one): one page.
    ("keydiff", 2048, {}, 16, 16),
    ("knorm", 2048, {}, 32, 32),
    ("streamingllm", 2048, {}, 16, 16),
    ("random", 2048, {}, 16, 16),
    ("h2o", 2048, {}, 16, 16),
    ("caote+h2o", 2048, {}, 16, 16),
    ("tova", 2048, {}, 16, 16),
    ("ahakv", 2048, {}, 16, 16),
])
def test_default_slack(spec, budget, options, page, slack):
    config = from_spec(spec, budget, **options)
    assert config.slack is None and config.slack_for(page) == slack
    assert from_spec(spec, budget, slack=5, **options).slack_for(page) == 5  # a slack that is set wins
    assert "slack" not in config.to_dict()  # the default is derived, not stored


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
    (0, r"budget must be an integer in \[1, 2147483647\], got 0"),
    (-5, r"budget must be an integer in \[1, 2147483647\], got -5"),
    (64.0, r"budget must be an integer in \[1, 2147483647\], got 64.0"),
    ("64", r"budget must be an integer in \[1, 2147483647\], got '64'"),
    (True, r"budget must be an integer in \[1, 2147483647\], got True"),
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
    ("snapkv", {"window": -1}, r"window must be an integer in \[1, 2147483647\], got -1"),
    ("snapkv", {"window": 0}, r"window must be an integer in \[1, 2147483647\], got 0"),
    ("snapkv", {"sinks": -2}, r"sinks must be an integer in \[0, 2147483647\], got -2"),
    ("h2o", {"recent": -1}, r"recent must be an integer in \[0, 2147483647\], got -1"),
    ("caote+tova", {"sinks": -1}, r"sinks must be an integer in \[0, 2147483647\], got -1"),
    ("snapkv", {"kernel": 4}, r"kernel must be an odd integer in \[1, 31\] \(pooling keeps the length\), got 4"),
    ("criticalkv+snapkv", {"kernel": 0}, r"kernel must be an odd integer in \[1, 31\] \(pooling keeps the length\), got 0"),
    ("snapkv", {"pooling": "median"}, r"pooling must be one of avg, max, none; got 'median'"),
    ("snapkv", {"foo": 1}, r"unknown option 'foo' for snapkv; valid options: .*kernel.*window"),
    ("caote+snapkv", {"alpha": 0.5}, r"unknown option 'alpha' for caote\+snapkv; valid options: .*caote_mode"),
    ("criticalkv+h2o", {"window": 8}, r"unknown option 'window' for criticalkv\+h2o; valid options: .*epsilon"),
    ("snapkv", {"schedule": "eager"}, r"schedule must be one of chunked, oneshot; got 'eager'"),
    ("h2o", {"slack": 0}, r"slack must be an integer in \[1, 2147483647\], got 0"),
    ("h2o", {"slack": -16}, r"slack must be an integer in \[1, 2147483647\], got -16"),
    ("h2o", {"slack": "16"}, r"slack must be an integer in \[1, 2147483647\], got '16'"),
    ("h2o", {"seed": -1}, r"seed must be an integer in \[0, 9223372036854775807\], got -1"),
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


# ---- bounds: every value fits the engine's arithmetic, every message is short ------------------------
M = 2**31 - 1


@pytest.mark.parametrize("spec,options,message", [
    ("h2o", {"seed": 2**63}, r"seed must be an integer in \[0, 9223372036854775807\], got 9223372036854775808"),
    ("h2o", {"seed": 2**64}, r"seed must be an integer in \[0, 9223372036854775807\], got 18446744073709551616"),
    ("h2o", {"seed": 10**400}, r"seed must be an integer in .*, got an integer of 1329 bits$"),
    ("h2o", {"slack": 2**31}, rf"slack must be an integer in \[1, {M}\], got 2147483648"),
    ("snapkv", {"kernel": 33}, r"kernel must be an odd integer in \[1, 31\] \(pooling keeps the length\), got 33"),
    ("snapkv", {"kernel": 134217729}, r"kernel must be an odd integer in \[1, 31\]"),
    ("ahakv", {"value_kernel": 2**40 + 1}, r"value_kernel must be an odd integer in \[1, 31\]"),
    ("snapkv", {"window": 2**31}, rf"window must be an integer in \[1, {M}\]"),
    ("nacl", {"temperature": float("nan")}, r"temperature must be a number in \[0.0001, 10000\], got nan"),
    ("nacl", {"temperature": float("inf")}, r"temperature must be a number in \[0.0001, 10000\], got inf"),
    ("nacl", {"random_ratio": 10**400}, r"random_ratio must be a number in \[0, 1\], got an integer of 1329 bits"),
    ("criticalkv+snapkv", {"alpha": float("-inf")}, r"alpha must be a number in \(0, 1\], got -inf"),
    ("criticalkv+snapkv", {"epsilon": 2.0}, r"epsilon must be a number in \[0, 1\], got 2.0"),
    ("caote+snapkv", {"eps": float("nan")}, r"eps must be a number in \(0, 1\), got nan"),
    ("snapkv", {"pooling": ["avg"]}, r"pooling must be one of avg, max, none; got a list of 1 entries"),
    ("snapkv", {"pooling": {"a": 1}}, r"pooling must be one of avg, max, none; got a JSON object of 1 entries"),
    ("snapkv", {"pooling": "x" * 10**6}, r"pooling must be one of avg, max, none; got 'x{64}'\.\.\. \(1000000 characters\)$"),
    ("tova", {"heads": True}, r"heads must be one of layer, group; got True"),
    ("snapkv", {"window": [32]}, rf"window must be an integer in \[1, {M}\], got a list of 1 entries"),
    ("snapkv", {"x" * 10**5: 1}, r"unknown option 'x{64}'\.\.\. \(100000 characters\) for snapkv"),
])
def test_values_out_of_range_are_refused_with_a_short_message(spec, options, message):
    with pytest.raises(ValueError, match=message) as info:
        from_spec(spec, **options)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("spec", [1, 10**5000, "caote+" * 10**5, ["snapkv"]], ids=["int", "huge-int", "huge-str", "list"])
def test_a_bad_spec_is_never_echoed_in_full(spec):
    with pytest.raises(ValueError) as info:
        from_spec(spec)
    assert len(str(info.value)) < 400


def test_the_largest_values_are_accepted():
    cfg = from_spec("nacl", M, seed=2**63 - 1, slack=M, temperature=1e4, random_ratio=1)
    assert cfg.seed == 2**63 - 1 and cfg.budget == M
    assert from_spec("snapkv", kernel=31).options["kernel"] == 31
