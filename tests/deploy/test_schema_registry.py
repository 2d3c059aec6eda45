"""The chart's values.schema.json and vllm_evict's policy registry agree.

The schema's eviction.policy enum and eviction.config option names are generated from the registry by
deploy/helm/sync_schema.py; these tests fail when someone adds or renames a policy or an option
without regenerating (the message gives the command), and check the generator against the parser:
every spec the schema allows builds, every one it leaves out is refused by the server's own config code.
About 2 s (imports the policy library).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from vllm_evict.config import EvictionConfig
from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "deploy" / "helm" / "vllm-evict" / "values.schema.json"


def _load_sync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_schema", REPO / "deploy" / "helm" / "sync_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync = _load_sync()


def schema() -> dict:
    return json.loads(SCHEMA.read_text())


def policy_enum() -> list[str]:
    return schema()["properties"]["eviction"]["properties"]["policy"]["enum"]


def test_schema_is_in_sync_with_the_registry() -> None:
    stale = sync.differences(schema())
    assert not stale, ("deploy/helm/vllm-evict/values.schema.json disagrees with the policy registry:\n  "
                       + "\n  ".join(stale) + "\nrun `.venv/bin/python deploy/helm/sync_schema.py`")


def test_every_allowed_policy_builds() -> None:
    for spec in policy_enum()[1:]:
        config = EvictionConfig.from_spec(spec, 4096)
        assert config.policy == spec


def test_every_combination_left_out_is_refused_by_the_server_config() -> None:
    """All single names and META+BASE / BASE+BASE / META+META pairs: in the enum iff the server's config
    code accepts them (with a budget large enough for every policy)."""
    allowed = set(policy_enum())
    names = [*BASE_POLICIES, *META_POLICIES]
    candidates = names + [f"{a}+{b}" for a in names for b in names]
    for spec in candidates:
        try:
            EvictionConfig.from_spec(spec, 4096)
            accepted = True
        except ValueError:
            accepted = False
        assert accepted == (spec in allowed), f"{spec}: server accepts={accepted}, schema allows={spec in allowed}"
    assert allowed - set(candidates) == {"none"}


def test_smallest_budgets_are_exact() -> None:
    """The schema's per-policy minimum budget is the server's: one less is refused, it and every larger
    budget (up to 512) are accepted."""
    rules = schema()["properties"]["eviction"]["allOf"]
    minimum = {spec: rule["then"]["properties"]["budget"]["minimum"]
               for rule in rules for spec in rule["if"]["properties"]["policy"]["enum"]}
    for spec in policy_enum()[1:]:
        low = minimum.get(spec, 1)
        if low > 1:
            with pytest.raises(ValueError, match=f"budget {low - 1} "):
                EvictionConfig.from_spec(spec, low - 1)
        for budget in range(low, 513):
            EvictionConfig.from_spec(spec, budget)
    assert minimum["snapkv"] == 33 and minimum["caote+snapkv"] == 33 and "keydiff" not in minimum


def test_config_options_cover_every_policy_option() -> None:
    properties = schema()["properties"]["eviction"]["properties"]["config"]["properties"]
    for name in [*BASE_POLICIES, *META_POLICIES]:
        for option, default in load_class(name).defaults.items():
            assert option in properties, f"{name}'s option {option!r} is missing from the schema"
            kind = properties[option].get("type")
            if isinstance(default, bool):
                assert kind == "boolean", option
            elif isinstance(default, int):
                assert kind in ("integer", "number"), option
            elif isinstance(default, float):
                assert kind == "number", option
    assert {"schedule", "slack", "seed"} <= set(properties)


def test_check_mode_names_what_is_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = schema()
    evict = stale["properties"]["eviction"]["properties"]
    evict["policy"]["enum"] = [p for p in evict["policy"]["enum"] if p != "keydiff"] + ["oldpolicy"]
    del evict["config"]["properties"]["window"]
    path = tmp_path / "values.schema.json"
    path.write_text(json.dumps(stale))
    assert sync.main(["--check", "--schema", str(path)]) == 1
    out = capsys.readouterr()
    assert "eviction.policy: the registry has ['keydiff'], the schema does not" in out.out
    assert "eviction.policy: the schema allows ['oldpolicy'], the registry does not know them" in out.out
    assert "eviction.config.window: registry {'type': 'integer'}, schema None" in out.out
    assert "is stale: run `python deploy/helm/sync_schema.py`" in out.err
    # Rewriting fixes it, and leaves the hand-written rest of the schema as it was.
    assert sync.main(["--schema", str(path)]) == 0
    assert sync.main(["--check", "--schema", str(path)]) == 0
    assert json.loads(path.read_text()) == schema()


def test_helm_renders_every_registry_policy() -> None:
    """Through helm itself: each registry spec passes the schema and reaches the server's command line."""
    pytest.importorskip("helm_python", reason="needs helm-python-sdk (make install)")
    from tests.deploy.chart import container, find, render

    for spec in policy_enum()[1:]:
        args = container(find(render({"eviction": {"policy": spec, "budget": 4096}}), "Deployment"), "server")["args"]
        assert args[args.index("--kv-eviction") + 1] == spec
