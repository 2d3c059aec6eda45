"""``EvictionConfig``: the one validated description of what to evict, used by the engine, the CLI,
the HF reference runner and the tests alike; ``ServerConfig``: a server's config plus the options only a
server may set (``SERVER_OPTIONS``).

A policy spec is ``[META+]BASE``: ``snapkv``, ``keydiff``, ``caote+h2o``, ``criticalkv+snapkv``.
Engine-level knobs (``schedule``, ``slack``, ``seed``, ``mode``) sit next to the policy's own options.
Every value is bounded (``vllm_evict.policies.options``; docs/security.md lists the ranges), so whatever
passes here fits the engine's int64/int32 arithmetic. A request is resolved against its server in
``vllm_evict.request_settings``, which adds the engine's own bounds (``max_model_len``, ``max_window``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from vllm_evict.policies import BASE_POLICIES, META_POLICIES, load_class
from vllm_evict.policies.base import Policy
from vllm_evict.policies.options import MAX_SEED, MAX_TOKENS, check_bool, check_choice, check_int, show
from vllm_evict.schedule import SCHEDULES

ENGINE_OPTIONS = ("schedule", "slack", "seed", "mode")
# Options of the server alone (``ServerConfig``), never of a request; ``EvictionConfig.from_mapping``
# skips them so that a server's mapping reads as its eviction config too.
SERVER_OPTIONS = ("max_window", "request_policies")
# Server options of earlier versions, and why they are gone.
REMOVED_OPTIONS = {
    "window_ring": "window_ring was removed: a request inside a decode window now keeps its window's queries in "
                   "free pages of the KV pool by default (docs/engine.md#observation-windows); drop the option",
}
# Options whose value is a width in tokens read through queries (or kept as such): at most max_window.
WINDOW_OPTIONS = ("window", "proxy", "recent")
MAX_WINDOW = 4096  # the largest max_window a server may reserve (NaCl's automatic rule needs <= 1024)
DEFAULT_MIN_WINDOW = 32  # max_window is at least this by default: SnapKV's usual window fits any server
# Default decode slack of a method that reads a query window at its decode evictions: this many windows,
# so that at most 1/4 of its decode steps carry window work (the others run full CUDA graphs and evict
# nothing), and at most half the budget, so a request holds at most 1.5x its budget (docs/engine.md#decode-slack).
SLACK_WINDOWS = 4
SLACK_MAX_BUDGET_SHARE = 2  # slack <= budget // this
MAX_SPEC_CHARS = 64  # a policy spec longer than this cannot name a method
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
        raise ValueError(f"eviction policy must be a string such as 'caote+snapkv', got {show(spec)}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"unknown eviction policy {show(spec)}; {valid_specs()}")
    parts = [p.strip().lower() for p in spec.strip().split("+")]
    if len(parts) == 1 and parts[0] in BASE_POLICIES:
        return None, parts[0]
    if len(parts) == 2 and parts[0] in META_POLICIES and parts[1] in BASE_POLICIES:
        return parts[0], parts[1]
    if len(parts) == 1 and parts[0] in META_POLICIES:
        raise ValueError(f"{parts[0]} is a meta score and needs a base, e.g. '{parts[0]}+snapkv'; {valid_specs()}")
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in META_POLICIES):
        raise ValueError(f"invalid eviction policy {show(spec)}: at most one meta score over one base; {valid_specs()}")
    if len(parts) == 2 and parts[0] in BASE_POLICIES and parts[1] in BASE_POLICIES:
        raise ValueError(f"invalid eviction policy {show(spec)}: {parts[0]} is a base, not a meta score; write "
                         f"META+BASE with META one of {', '.join(META_POLICIES)}; {valid_specs()}")
    unknown = [p for p in parts if p not in BASE_POLICIES and p not in META_POLICIES]
    name = unknown[0] if unknown else spec
    raise ValueError(f"unknown eviction policy {show(name)} in {show(spec)}; {valid_specs()}")


@dataclass(frozen=True)
class EvictionConfig:
    policy: str  # normalised spec, e.g. "caote+snapkv"
    budget: int  # tokens kept per (layer, KV head)
    schedule: str  # "chunked" (block-wise while prefilling) or "oneshot" (after the prompt)
    slack: int | None = None  # decode growth allowed before evicting back to budget (None: ``slack_for``)
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
        check_int("seed", seed, minimum=0, maximum=MAX_SEED)
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
        """From ``{"policy": "keydiff", "budget": 1024, "window": 32, ...}`` (additional_config, CLI JSON).

        A server's mapping may also hold ``SERVER_OPTIONS``, which are not part of an eviction config and
        are skipped here (``ServerConfig.from_mapping`` reads them)."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"eviction config must be a JSON object, got {show(mapping)}")
        data = {k: v for k, v in mapping.items() if k not in SERVER_OPTIONS}
        bad = [k for k in data if not isinstance(k, str) or k in ("cls", "spec")]
        if bad:
            raise ValueError(f"unknown option {show(bad[0])} in the eviction config")
        if "policy" not in data:
            raise ValueError(f"eviction config needs a 'policy' ({valid_specs()})")
        spec = data.pop("policy")
        budget = data.pop("budget", None)
        return cls.from_spec(spec, budget, **data)

    @property
    def elastic(self) -> bool:
        return self.mode == "elastic"

    def slack_for(self, page_size: int) -> int:
        """Decode slack in tokens: the configured one, or the default, decided here only: one KV page, and
        for a method that reads a window of queries at its decode evictions ``SLACK_WINDOWS`` windows, at
        most half the budget, in whole pages (never less than one)."""
        if self.slack is not None:
            return self.slack
        tokens = min(SLACK_WINDOWS * self._decode_window, self.budget // SLACK_MAX_BUDGET_SHARE)
        return max(1, -(-tokens // page_size)) * page_size

    @cached_property
    def _decode_window(self) -> int:
        """The widest query window a decode eviction of this config reads (0: none)."""
        policy = self.build_policy()
        if not (policy.accumulates_window and policy.window_in_decode):
            return 0
        window = policy.window_for(self.budget)
        return window if window > 1 else 0

    def build_policy(self, window_cap: int | None = None) -> Policy:
        """The policy instance; ``window_cap``: the engine's max_window, which bounds a window the policy
        sizes by itself (NaCl's automatic proxy count, ``Policy.cap_query_window``)."""
        meta, base = parse_spec(self.policy)
        policy = build_policy(meta, base, dict(self.options))
        if window_cap is not None:
            policy.cap_query_window(window_cap)
        return policy

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
    unknown = sorted((k for k in options if k not in meta_keys | base_keys), key=str)
    if unknown:
        spec = f"{meta}+{base}" if meta else base
        valid = sorted(meta_keys | base_keys | set(ENGINE_OPTIONS) | {"budget", "policy"})
        raise ValueError(f"unknown option {show(unknown[0])} for {spec}; valid options: {', '.join(valid)}")
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


def window_widths(config: EvictionConfig, policy: Policy) -> dict[str, int]:
    """The query widths a config asks of the engine, by what sets them: ``window_for(budget)`` (the
    queries it reads at its budget) and every set window-like option (``WINDOW_OPTIONS``)."""
    widths = {f"query window at budget {config.budget}": policy.window_for(config.budget)}
    options = getattr(policy, "base", policy).options  # a meta score reads its base's windows
    widths.update({name: options[name] for name in WINDOW_OPTIONS if isinstance(options.get(name), int)})
    return widths


# ---- the server: its eviction config and the options only it may set ------------------------------
@dataclass(frozen=True)
class ServerConfig:
    """What a server evicts by default (``eviction``) and what it reserves at start-up for requests:
    ``max_window``, the widest query window (SnapKV window, NaCl proxy count, AhaKV recent window) any
    request may use; ``request_policies``, methods clients may choose beyond those whose needs the
    server's own method covers. ``vllm_evict.reservation`` turns them into what the worker allocates."""

    eviction: EvictionConfig
    max_window: int
    request_policies: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> "ServerConfig":
        """From the server's ``kv_eviction`` mapping (``--kv-eviction*`` flags, ``additional_config``)."""
        removed = next((key for key in REMOVED_OPTIONS if isinstance(mapping, Mapping) and key in mapping), None)
        if removed is not None:
            raise ValueError(REMOVED_OPTIONS[removed])
        eviction = EvictionConfig.from_mapping(mapping)
        specs = mapping.get("request_policies", [])
        if not isinstance(specs, (list, tuple)) or len(specs) > len(BASE_POLICIES) * (len(META_POLICIES) + 1):
            raise ValueError(f"request_policies must be a list of eviction policies such as ['h2o', "
                             f"'criticalkv+snapkv'], got {show(specs)}")
        normalised = []
        for spec in specs:
            try:
                meta, base = parse_spec(spec)
                build_policy(meta, base, {})  # a meta score over a base it cannot wrap is refused here
            except ValueError as err:
                raise ValueError(f"request_policies: {err}") from None
            normalised.append(f"{meta}+{base}" if meta else base)
        if "max_window" in mapping:
            max_window = check_int("max_window", mapping["max_window"], minimum=1, maximum=MAX_WINDOW)
            widths = window_widths(eviction, eviction.build_policy(window_cap=max_window))
            widest = max(widths.values())
            if widest > max_window:
                what = next(name for name, width in widths.items() if width == widest)
                raise ValueError(f"max_window {max_window} is narrower than the server's own {what} ({widest}); "
                                 f"raise max_window to at least {widest} or leave it unset")
        else:
            widest = max(window_widths(eviction, eviction.build_policy()).values())
            max_window = max(DEFAULT_MIN_WINDOW, widest)
            if max_window > MAX_WINDOW:
                raise ValueError(f"the server's query window ({widest}) is wider than the largest max_window, "
                                 f"{MAX_WINDOW}; shrink it")
        return cls(eviction=eviction, max_window=max_window, request_policies=tuple(dict.fromkeys(normalised)))

    @property
    def ring(self) -> bool:
        """The server keeps a query ring: elastic requests need one (they can be compressed at any step)."""
        return self.eviction.elastic

    def to_dict(self) -> dict[str, Any]:
        return {**self.eviction.to_dict(), "max_window": self.max_window,
                "request_policies": list(self.request_policies)}


# ---- JSON text from clients -------------------------------------------------------------------------
MAX_CONFIG_CHARS = 4096  # the longest kv_eviction_config text a request may send


def parse_json_object(text: str, name: str, max_chars: int = MAX_CONFIG_CHARS) -> dict[str, Any]:
    """A JSON object from client text, strictly: at most ``max_chars`` characters, no NaN / Infinity
    literals, no duplicate keys, no nesting deeper than Python can parse (every failure a ValueError
    naming ``name`` and showing at most a short prefix of the text)."""
    if len(text) > max_chars:
        raise ValueError(f"{name} must be a JSON object of at most {max_chars} characters, got {len(text)}")

    def refuse_constant(literal: str) -> Any:
        raise ValueError(f"{name}: {literal} is not a number here; numbers must be finite")

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{name} has the key {show(key)} twice")
            seen[key] = value
        return seen

    try:
        value = json.loads(text, parse_constant=refuse_constant, object_pairs_hook=unique_keys)
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply; it must be a flat JSON object of options") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} must be a JSON object, got {show(text)} ({err.msg} at character {err.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {show(text)}")
    return value
