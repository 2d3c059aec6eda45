"""Per-request eviction settings: parsed and validated once in the front end, checked again where the
engine first sees a request, and carried in between in one canonical form.

A request sets its eviction with these keys of ``SamplingParams.extra_args`` (the OpenAI API's
``vllm_xargs``): ``kv_eviction`` (a method, or ``"none"``), ``kv_budget`` and ``kv_eviction_config`` (an
object of options: a mapping in Python, JSON text over HTTP). ``resolve`` turns them, with the server's
``ServerConfig`` and ``Reservation``, into the request's ``EvictionConfig`` (or None: eviction off) and a
canonical form: a plain dict of ints, floats, strings and None (``EvictionConfig.to_dict``, or
``{"policy": "none"}``) that the front end puts under ``RESOLVED_KEY`` in place of the request's own keys
(``carry``). Whatever a client puts under ``RESOLVED_KEY`` itself is validated exactly like the rest, so
it grants nothing.

Where it runs:
* front end: the OpenAI handlers (before a streamed response's 200) and ``InputProcessor.process_inputs``
  (every request of ``LLM`` and of the servers), see ``vllm_evict.plugin``;
* engine intake: ``EvictScheduler.add_request`` runs ``resolve`` again (on the canonical dict, no JSON),
  for requests that did not come through this front end, and refuses a bad one without raising there;
* the worker reads the canonical dict of a request the scheduler accepted (``config_of_extra_args``)
  and never parses JSON.

Every refusal is a ``RequestRefused`` (a ValueError) whose message names the key, the allowed range and at
most a short prefix of the bad value; ``reason`` is the label of the rejection metric.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_evict.config import (DISABLED, ENGINE_OPTIONS, SERVER_OPTIONS, EvictionConfig, ServerConfig,
                               parse_json_object, parse_spec)
from vllm_evict.policies.options import MAX_TOKENS, check_int, show
from vllm_evict.reservation import Reservation, refusal, server_reservation

REQUEST_KEYS = ("kv_eviction", "kv_budget", "kv_eviction_config")
RESOLVED_KEY = "kv_eviction_resolved"  # the canonical settings, written by the front end (and the engine)
OFF = {"policy": "none"}  # canonical form of "eviction off for this request"
# Any other extra_args key that looks like one of ours is a typo, refused rather than ignored.
_OUR_PREFIXES = ("kv_evict", "kv_budget")
PREFIX = "invalid per-request KV eviction settings: "

# rejection reasons (the label of vllm:kv_eviction_rejected_requests_total)
INVALID = "invalid_settings"  # a value out of range, an unknown key or method, bad JSON
NOT_RESERVED = "not_reserved"  # valid, but needs more than the server reserved at start-up


class RequestRefused(ValueError):
    def __init__(self, message: str, reason: str = INVALID) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Resolved:
    config: EvictionConfig | None  # None: eviction off for this request
    canonical: dict[str, Any] | None  # what to carry under RESOLVED_KEY; None: the server's own settings


# ---- the server's side, parsed once per process --------------------------------------------------
_SERVERS: dict[str, tuple[ServerConfig, Reservation]] = {}


def server_settings(mapping: Mapping[str, Any] | None) -> tuple[ServerConfig, Reservation] | None:
    """The ``ServerConfig`` and ``Reservation`` of a server's ``kv_eviction`` mapping (None: eviction
    off on this server); parsed once per distinct mapping in this process."""
    if not mapping:
        return None
    key = json.dumps(mapping, sort_keys=True, default=repr)
    found = _SERVERS.get(key)
    if found is None:
        server = ServerConfig.from_mapping(mapping)
        found = _SERVERS[key] = (server, server_reservation(server))
    return found


def server_mapping(vllm_config: Any) -> dict[str, Any] | None:
    """The server-wide eviction settings exactly as the user gave them (additional_config)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    mapping = extra.get("kv_eviction")
    return dict(mapping) if mapping else None


# ---- one request -----------------------------------------------------------------------------------
def has_settings(extra_args: Mapping[str, Any] | None) -> bool:
    """Whether ``extra_args`` holds any eviction key (ours or a typo of one)."""
    return isinstance(extra_args, Mapping) and any(isinstance(k, str) and k.startswith(_OUR_PREFIXES)
                                                   for k in extra_args)


def resolve(server: tuple[ServerConfig, Reservation] | None, extra_args: Mapping[str, Any] | None, *,
            max_model_len: int | None = None) -> Resolved:
    """The eviction of one request on a server (``server_settings``; None: no eviction there), from its
    ``extra_args``. Raises ``RequestRefused`` with a message meant for the API caller."""
    if not has_settings(extra_args):
        return Resolved(server[0].eviction if server else None, None)
    assert extra_args is not None
    unknown = [k for k in extra_args if isinstance(k, str) and k.startswith(_OUR_PREFIXES)
               and k not in (*REQUEST_KEYS, RESOLVED_KEY)]
    if unknown:
        raise RequestRefused(f"{PREFIX}unknown key {show(unknown[0])}; the eviction keys are "
                             f"{', '.join(REQUEST_KEYS)}")
    raw = {k: extra_args[k] for k in REQUEST_KEYS if k in extra_args}
    limit = max_model_len or MAX_TOKENS
    if server is not None:  # a server's own budget / slack may exceed max_model_len (it then never evicts)
        limit = max(limit, server[0].eviction.budget, server[0].eviction.slack or 0)
    if raw:
        config = _from_request_keys(server, raw, limit)
    else:
        config = _from_canonical(server, extra_args[RESOLVED_KEY], limit)
    if config is None:
        return Resolved(None, dict(OFF))
    assert server is not None
    message = refusal(config, server[1])
    if message is not None:
        raise RequestRefused(PREFIX + message, NOT_RESERVED)
    return Resolved(config, config.to_dict())


def carry(extra_args: Mapping[str, Any] | None, resolved: Resolved) -> dict[str, Any]:
    """``extra_args`` with the request's eviction keys replaced by the canonical settings."""
    rest = {k: v for k, v in (extra_args or {}).items() if k not in REQUEST_KEYS and k != RESOLVED_KEY}
    if resolved.canonical is not None:
        rest[RESOLVED_KEY] = resolved.canonical
    return rest


def config_of_extra_args(server: EvictionConfig | None, extra_args: Mapping[str, Any] | None) -> EvictionConfig | None:
    """The worker's view: the canonical settings the scheduler accepted (no JSON, no overrides to merge),
    or the server's config when the request carries none."""
    canonical = (extra_args or {}).get(RESOLVED_KEY)
    if canonical is None:
        return server
    if dict(canonical) == OFF:
        return None
    return EvictionConfig.from_mapping(canonical)


def resolve_request_config(server: Mapping[str, Any] | None, extra_args: Mapping[str, Any] | None, *,
                           max_model_len: int | None = None) -> EvictionConfig | None:
    """The eviction config of one request (None: eviction off) from the server's ``kv_eviction`` mapping
    and the request's ``extra_args``: ``resolve`` for callers holding a mapping (tests, benchmarks)."""
    return resolve(server_settings(server), extra_args, max_model_len=max_model_len).config


# ---- the two forms ---------------------------------------------------------------------------------
def _from_request_keys(server: tuple[ServerConfig, Reservation] | None, raw: dict[str, Any],
                       limit: int) -> EvictionConfig | None:
    requested = raw.get("kv_eviction")
    if "kv_eviction" in raw and not isinstance(requested, str):
        raise RequestRefused(f"{PREFIX}kv_eviction must be a method such as 'snapkv' or 'none', got {show(requested)}")
    off = isinstance(requested, str) and requested.strip().lower() in DISABLED
    if server is None:
        if off and set(raw) == {"kv_eviction"}:
            return None  # turning off what is already off
        raise RequestRefused("this server runs without KV eviction, so kv_eviction/kv_budget/kv_eviction_config "
                             "cannot be set per request; start it with --kv-eviction POLICY --kv-budget N")
    if off:
        if set(raw) - {"kv_eviction"}:
            raise RequestRefused("kv_eviction 'none' turns eviction off for this request; drop kv_budget and "
                                 "kv_eviction_config")
        return None
    base = server[0].eviction
    try:
        data = base.to_dict()
        if requested is not None and parse_spec(requested) != parse_spec(base.policy):
            # Another method: the server's method-specific options may not apply; keep engine-level knobs.
            data = {k: v for k, v in data.items() if (k in ENGINE_OPTIONS and k != "schedule") or k == "budget"}
        if requested is not None:
            data["policy"] = requested
        if "kv_budget" in raw:
            data["budget"] = check_int("kv_budget", raw["kv_budget"], minimum=1, maximum=limit)
        data.update(_options(raw.get("kv_eviction_config", {}), limit))
        return EvictionConfig.from_mapping(data)
    except RequestRefused:
        raise
    except ValueError as err:
        raise RequestRefused(f"{PREFIX}{err}") from None


def _options(value: Any, limit: int) -> dict[str, Any]:
    """The options of ``kv_eviction_config``: JSON text (HTTP) or a mapping (Python), flat, with only keys
    a request may set; the token-count engine knobs bounded by max_model_len."""
    name = "kv_eviction_config"
    if isinstance(value, str):
        options = parse_json_object(value, name)
    elif isinstance(value, Mapping):
        options = dict(value)
    else:
        raise ValueError(f"{name} must be a JSON object, got {show(value)}")
    for key in options:
        if not isinstance(key, str):
            raise ValueError(f"{name}: option names are strings, got {show(key)}")
        if key in SERVER_OPTIONS:
            raise ValueError(f"{name}: {key} is a server option (set it with --kv-eviction-config when the server "
                             f"starts), not a per-request one")
        if key in ("policy", "budget"):
            raise ValueError(f"{name}: set the {'method with kv_eviction' if key == 'policy' else 'budget with kv_budget'}, "
                             f"not with {key} in {name}")
    if "slack" in options:
        check_int("slack", options["slack"], minimum=1, maximum=limit)
    return options


def _from_canonical(server: tuple[ServerConfig, Reservation] | None, canonical: Any,
                    limit: int) -> EvictionConfig | None:
    if not isinstance(canonical, Mapping):
        raise RequestRefused(f"{PREFIX}{RESOLVED_KEY} must be an object, got {show(canonical)}")
    if dict(canonical) == OFF:
        return None
    if server is None:
        raise RequestRefused("this server runs without KV eviction, so eviction cannot be set per request; start "
                             "it with --kv-eviction POLICY --kv-budget N")
    try:
        if any(key in SERVER_OPTIONS for key in canonical):
            raise ValueError(f"{RESOLVED_KEY} may not set server options ({', '.join(SERVER_OPTIONS)})")
        config = EvictionConfig.from_mapping(canonical)
        check_int("budget", config.budget, minimum=1, maximum=limit)
        if config.slack is not None:
            check_int("slack", config.slack, minimum=1, maximum=limit)
        return config
    except ValueError as err:
        raise RequestRefused(f"{PREFIX}{err}") from None
