"""Rewrite the registry-derived parts of the chart's values.schema.json from vllm_evict's policy registry.

    .venv/bin/python deploy/helm/sync_schema.py           # rewrite the schema in place
    .venv/bin/python deploy/helm/sync_schema.py --check   # exit 1 and say what differs

Two parts of the schema come from the registry, so that `helm install` refuses exactly what the
server would refuse by name:

* ``eviction.policy.enum``: "none", every base policy, and every META+BASE pair the meta score accepts
  (the same rule ``vllm_evict.config.build_policy`` applies);
* ``eviction.config.properties``: the engine options (schedule, slack, seed, mode), the server-only
  options (max_window, request_policies: docs/configuration.md) and every policy option name, typed after its
  default value. Which option applies to which policy is checked by the server
  at start-up; the schema only refuses names no policy knows and values of the wrong type;
* ``eviction.allOf``: the smallest budget each policy accepts with its default options (the budget must
  exceed the tokens it always keeps, e.g. SnapKV's window of 32), applied while eviction.config sets no
  policy option (with policy options the server checks the budget at start-up).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "vllm-evict" / "values.schema.json"
DISABLED_POLICY = "none"  # the chart's value for "serve plain vLLM"

# JSON-schema type of an option, from the Python type of its default (bool before int: bool is an int).
_JSON_TYPES: tuple[tuple[type, str], ...] = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))


def policy_names() -> list[str]:
    """Every spec the server accepts by name, in registry order, "none" first."""
    from vllm_evict.config import parse_spec
    from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class

    names = [DISABLED_POLICY, *BASE_POLICIES]
    for meta in META_POLICIES:
        meta_cls = load_class(meta)
        names += [f"{meta}+{base}" for base in BASE_POLICIES if meta_cls.accepts(load_class(base))]
    for spec in names[1:]:
        parse_spec(spec)  # raises if the registry and the parser disagree
    return names


def _json_type(value: Any) -> str | None:
    for py_type, json_type in _JSON_TYPES:
        if isinstance(value, py_type):
            return json_type
    return None  # e.g. a None default ("derived from the budget"): any type, the server checks it


def config_properties() -> dict[str, dict[str, Any]]:
    """Property schema of every option name a policy or the engine knows."""
    from vllm_evict.config import ENGINE_OPTIONS, MAX_WINDOW, MODES, SERVER_OPTIONS
    from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
    from vllm_evict.policies.options import MAX_SEED, MAX_TOKENS
    from vllm_evict.schedule import SCHEDULES

    engine = {"schedule": {"enum": list(SCHEDULES)}, "slack": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
              "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED}, "mode": {"enum": list(MODES)},
              "max_window": {"type": "integer", "minimum": 1, "maximum": MAX_WINDOW},
              "request_policies": {"type": "array", "items": {"enum": policy_names()[1:]}}}
    missing = set(ENGINE_OPTIONS) - set(engine) | set(SERVER_OPTIONS) - set(engine)
    if missing:
        raise RuntimeError(f"engine options {sorted(missing)} have no schema here: add them to config_properties()")
    types: dict[str, set[str | None]] = {}
    for name in [*BASE_POLICIES, *META_POLICIES]:
        for option, default in load_class(name).defaults.items():
            types.setdefault(option, set()).add(_json_type(default))
    props: dict[str, dict[str, Any]] = {}
    for option in sorted(types):
        # A None default ("derived from the budget", e.g. H2O's recent window) takes the type the option
        # has elsewhere, or any type when no policy gives it one: the server checks the value.
        found = types[option] - {None}
        if not found:
            props[option] = {}
        elif found == {"integer", "number"}:
            props[option] = {"type": "number"}  # an int default where another policy has a float one
        elif len(found) == 1:
            props[option] = {"type": found.pop()}
        else:
            props[option] = {}
    return {**engine, **props}


def min_budget(spec: str, limit: int = 1 << 16) -> int:
    """The smallest budget ``spec`` accepts with its default options."""
    from vllm_evict.config import EvictionConfig

    for budget in range(1, limit):
        try:
            EvictionConfig.from_spec(spec, budget)
            return budget
        except ValueError:
            continue
    raise RuntimeError(f"{spec} accepts no budget below {limit}")


def budget_rules() -> list[dict[str, Any]]:
    """One if/then per smallest budget above 1: policies in the group, no policy option set -> minimum."""
    from vllm_evict.config import ENGINE_OPTIONS, SERVER_OPTIONS

    groups: dict[int, list[str]] = {}
    for spec in policy_names()[1:]:
        groups.setdefault(min_budget(spec), []).append(spec)
    rules = []
    for minimum in sorted(m for m in groups if m > 1):
        rules.append({
            "if": {"required": ["policy"],
                   "properties": {"policy": {"enum": groups[minimum]},
                                  "config": {"propertyNames": {"enum": [*ENGINE_OPTIONS, *SERVER_OPTIONS]}}}},
            "then": {"properties": {"budget": {"minimum": minimum}}},
        })
    return rules


def synced(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` with the registry-derived parts replaced."""
    out = json.loads(json.dumps(schema))
    eviction = out["properties"]["eviction"]
    eviction["properties"]["policy"]["enum"] = policy_names()
    eviction["properties"]["config"]["properties"] = config_properties()
    eviction["allOf"] = budget_rules()
    return out


def differences(schema: dict[str, Any]) -> list[str]:
    """What the registry says that ``schema`` does not, one line each (empty: in sync)."""
    want_eviction = synced(schema)["properties"]["eviction"]
    have_eviction = schema["properties"]["eviction"]
    want, have = want_eviction["properties"], have_eviction["properties"]
    lines = []
    missing = [p for p in want["policy"]["enum"] if p not in have["policy"].get("enum", [])]
    extra = [p for p in have["policy"].get("enum", []) if p not in want["policy"]["enum"]]
    if missing:
        lines.append(f"eviction.policy: the registry has {missing}, the schema does not")
    if extra:
        lines.append(f"eviction.policy: the schema allows {extra}, the registry does not know them")
    want_props, have_props = want["config"]["properties"], have["config"].get("properties", {})
    for option in sorted(set(want_props) | set(have_props)):
        if want_props.get(option) != have_props.get(option):
            lines.append(f"eviction.config.{option}: registry {want_props.get(option)!r}, "
                         f"schema {have_props.get(option)!r}")
    if want_eviction["allOf"] != have_eviction.get("allOf"):
        lines.append("eviction.allOf: the smallest budgets per policy differ from the registry's")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the schema is stale")
    parser.add_argument("--schema", type=Path, default=SCHEMA_PATH)
    args = parser.parse_args(argv)
    schema = json.loads(args.schema.read_text())
    if args.check:
        lines = differences(schema)
        for line in lines:
            print(line)
        if lines:
            print(f"{args.schema} is stale: run `python deploy/helm/sync_schema.py`", file=sys.stderr)
        return 1 if lines else 0
    args.schema.write_text(json.dumps(synced(schema), indent=2) + "\n")
    print(f"wrote {args.schema}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
