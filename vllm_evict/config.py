"""``EvictionConfig``: the one validated description of what to evict, used by the engine, the CLI,
the HF reference runner and the tests alike.

A policy spec is ``[META+]BASE``: ``snapkv``, ``keydiff``, ``caote+h2o``, ``criticalkv+snapkv``.
Engine-level knobs (``schedule``, ``slack``, ``seed``, ``mode``) sit next to the policy's own options.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
from vllm_evict.policies.base import Policy
from vllm_evict.policies.options import check_choice, check_int
from vllm_evict.schedule import SCHEDULES

ENGINE_OPTIONS = ("schedule", "slack", "seed", "mode")
# fixed: the budget is a ceiling, kept by the schedule; elastic: the budget is a floor, and requests are
# compressed toward it only when the KV pool runs short (instead of preempting).
MODES = ("fixed", "elastic")
DISABLED = ("none", "off", "")


def valid_specs() -> str:
    bases = ", ".join(BASE_POLICIES)
    metas = ", ".join(f"{m}+BASE" for m in META_POLICIES)
    return f"bases: {bases}; meta scores: {metas}"


def parse_spec(spec: Any) -> tuple[str | None, str]:
    """'caote+snapkv' -> ('caote', 'snapkv'); 'keydiff' -> (None, 'keydiff')."""
    if not isinstance(spec, str):
        raise ValueError(f"eviction policy must be a string such as 'caote+snapkv', got {spec!r}")
    parts = [p.strip().lower() for p in spec.strip().split("+")]
    if len(parts) == 1 and parts[0] in BASE_POLICIES:
        return None, parts[0]
    if len(parts) == 2 and parts[0] in META_POLICIES and parts[1] in BASE_POLICIES:
        return parts[0], parts[1]
    if len(parts) == 1 and parts[0] in META_POLICIES:
        raise ValueError(f"{parts[0]} is a meta score and needs a base, e.g. '{parts[0]}+snapkv'; {valid_specs()}")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in META_POLICIES):
        raise ValueError(f"invalid eviction policy {spec!r}: at most one meta score over one base; {valid_specs()}")
    if len(parts) == 2 and parts[0] in BASE_POLICIES and parts[1] in BASE_POLICIES:
        raise ValueError(f"invalid eviction policy {spec!r}: {parts[0]} is a base, not a meta score; write "
                         f"META+BASE with META one of {', '.join(META_POLICIES)}; {valid_specs()}")
    unknown = [p for p in parts if p not in BASE_POLICIES and p not in META_POLICIES]
    name = unknown[0] if unknown else spec
    raise ValueError(f"unknown eviction policy {name!r} in {spec!r}; {valid_specs()}")


@dataclass(frozen=True)
class EvictionConfig:
    policy: str  # normalised spec, e.g. "caote+snapkv"
    budget: int  # tokens kept per (layer, KV head)
    schedule: str  # "chunked" (block-wise while prefilling) or "oneshot" (after the prompt)
    slack: int | None = None  # decode growth allowed before evicting back to budget (None: one page)
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "fixed"  # "fixed" or "elastic" (see MODES)

    @classmethod
    def from_spec(cls, spec: str, budget: Any = None, *, schedule: str | None = None, slack: Any = None,
                  seed: Any = 0, mode: Any = "fixed", **options: Any) -> "EvictionConfig":
        meta, base = parse_spec(spec)
        if budget is None:
            raise ValueError("a KV budget is required: pass budget (tokens kept per layer and KV head), e.g. 2048")
        check_int("budget", budget, minimum=1)
        if slack is not None:
            check_int("slack", slack, minimum=1)
        check_int("seed", seed, minimum=0)
        check_choice("mode", mode, MODES)
        normalised = f"{meta}+{base}" if meta else base
        policy = build_policy(meta, base, options)  # validates option names and values
        if schedule is None:
            schedule = "oneshot" if policy.one_shot else "chunked"
        check_choice("schedule", schedule, SCHEDULES)
        protected = policy.protected_count(budget)
        if protected >= budget:
            raise ValueError(
                f"budget {budget} must be larger than the {protected} tokens {normalised} always keeps "
                f"({_describe_protected(policy)}); raise the budget or shrink those options")
        policy.validate(budget)
        return cls(policy=normalised, budget=budget, schedule=schedule, slack=slack, seed=seed,
                   options=dict(options), mode=mode)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "EvictionConfig":
        """From ``{"policy": "keydiff", "budget": 1024, "window": 32, ...}`` (additional_config, CLI JSON)."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"eviction config must be a JSON object, got {mapping!r}")
        data = dict(mapping)
        bad = [k for k in data if not isinstance(k, str) or k in ("cls", "spec")]
        if bad:
            raise ValueError(f"unknown option {bad[0]!r} in the eviction config")
        if "policy" not in data:
            raise ValueError(f"eviction config needs a 'policy' ({valid_specs()})")
        spec = data.pop("policy")
        budget = data.pop("budget", None)
        return cls.from_spec(spec, budget, **data)

    @property
    def elastic(self) -> bool:
        return self.mode == "elastic"

    def slack_for(self, page_size: int) -> int:
        """Decode slack in tokens: the configured one, or one KV page (the default, decided here only)."""
        return self.slack if self.slack is not None else page_size

    def build_policy(self) -> Policy:
        meta, base = parse_spec(self.policy)
        return build_policy(meta, base, dict(self.options))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy, "budget": self.budget, "schedule": self.schedule, "seed": self.seed}
        if self.slack is not None:
            out["slack"] = self.slack
        if self.mode != "fixed":
            out["mode"] = self.mode
        out.update(self.options)
        return out

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def build_policy(meta: str | None, base: str, options: Mapping[str, Any]) -> Policy:
    base_cls = load_class(base)
    meta_cls = load_class(meta) if meta else None
    if meta_cls is not None and not meta_cls.accepts(base_cls):
        valid = ", ".join(_accepting_bases(meta_cls))
        raise ValueError(f"{meta} cannot wrap {base}: it needs a base whose score is a non-negative "
                         f"attention mass; valid bases for {meta}: {valid}")
    meta_keys = set(meta_cls.defaults) if meta_cls else set()
    base_keys = set(base_cls.defaults)
    unknown = sorted(k for k in options if k not in meta_keys | base_keys)
    if unknown:
        spec = f"{meta}+{base}" if meta else base
        valid = sorted(meta_keys | base_keys | set(ENGINE_OPTIONS) | {"budget", "policy"})
        raise ValueError(f"unknown option {unknown[0]!r} for {spec}; valid options: {', '.join(valid)}")
    base_policy = base_cls(**{k: v for k, v in options.items() if k in base_keys and k not in meta_keys})
    base_policy.check_options()
    if meta_cls is None:
        return base_policy
    meta_policy = meta_cls(base_policy, **{k: v for k, v in options.items() if k in meta_keys})
    meta_policy.check_options()
    return meta_policy


def _accepting_bases(meta_cls: type[Policy]) -> list[str]:
    """Registered bases ``meta_cls`` can wrap (for messages; a base whose module fails to import is skipped)."""
    names = []
    for name in BASE_POLICIES:
        try:
            base_cls = load_class(name)
        except (ImportError, AttributeError):
            continue
        if meta_cls.accepts(base_cls):
            names.append(name)
    return names


def _describe_protected(policy: Policy) -> str:
    options = getattr(policy, "base", policy).options  # a meta score protects what its base protects
    parts = [f"{k} {options[k]}" for k in ("sinks", "window", "recent", "proxy") if options.get(k) is not None]
    return " + ".join(parts) if parts else "its protected tokens"


# ---- per-request overrides ----------------------------------------------------------------------
# Keys a request may put in SamplingParams.extra_args (OpenAI API: extra_body={"vllm_xargs": {...}}).
REQUEST_KEYS = ("kv_eviction", "kv_budget", "kv_eviction_config")


def resolve_request_config(server: Mapping[str, Any] | None, extra_args: Mapping[str, Any] | None) -> EvictionConfig | None:
    """The eviction config of one request: the server's, overridden by the request's extra_args.

    ``server`` is the server-wide mapping exactly as the user gave it (``additional_config
    ["kv_eviction"]``), or None when the server runs without eviction. Returns None when eviction is
    off for this request. Raises ValueError with a message meant for the API caller.
    """
    extra = {k: v for k, v in (extra_args or {}).items() if k in REQUEST_KEYS}
    if not extra:
        return EvictionConfig.from_mapping(server) if server else None
    if server is None:
        requested = extra.get("kv_eviction")
        if set(extra) == {"kv_eviction"} and isinstance(requested, str) and requested.strip().lower() in DISABLED:
            return None  # turning off what is already off
        raise ValueError("this server runs without KV eviction, so kv_eviction/kv_budget cannot be set per "
                         "request; start it with --kv-eviction POLICY --kv-budget N")
    policy = extra.get("kv_eviction", server.get("policy"))
    if isinstance(policy, str) and policy.strip().lower() in DISABLED:
        if set(extra) - {"kv_eviction"}:
            raise ValueError("kv_eviction 'none' turns eviction off for this request; drop kv_budget and "
                             "kv_eviction_config")
        return None
    try:
        data = dict(server)
        if "kv_eviction" in extra and parse_spec(policy) != parse_spec(server.get("policy")):
            # Another method: the server's method-specific options may not apply; keep engine-level knobs.
            data = {k: v for k, v in server.items() if (k in ENGINE_OPTIONS and k != "schedule") or k == "budget"}
        data["policy"] = policy
        if "kv_budget" in extra:
            data["budget"] = extra["kv_budget"]
        overrides = extra.get("kv_eviction_config", {})
        if isinstance(overrides, str):
            # OpenAI's vllm_xargs carries only strings, numbers and lists, so objects arrive as JSON text.
            try:
                overrides = json.loads(overrides)
            except json.JSONDecodeError:
                raise ValueError(f"kv_eviction_config must be a JSON object, got {overrides!r}") from None
        if not isinstance(overrides, Mapping):
            raise ValueError(f"kv_eviction_config must be a JSON object, got {overrides!r}")
        data.update(overrides)
        return EvictionConfig.from_mapping(data)
    except ValueError as err:
        raise ValueError(f"invalid per-request KV eviction settings: {err}") from None
