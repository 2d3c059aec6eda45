"""What a server reserves at start-up for eviction, and which requests that reservation cannot serve.

Nothing is allocated on behalf of a request after start-up: the worker allocates exactly the
``Reservation`` of the server's ``ServerConfig`` (its method plus ``request_policies``, and
``max_window``), and a request that would need more is refused before it reaches the engine (front end)
and again where the engine first sees it (``vllm_evict.request_settings``), with a message naming the
server option to change.

This module is pure: it imports nothing from vLLM and reads a policy only through ``state_names``,
``head_state_names`` (default none), ``needs_o_proj`` and ``window_for(budget)``, so it follows the
policies as they change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_evict.config import SERVER_OPTIONS, EvictionConfig, ServerConfig, build_policy, parse_spec, window_widths
from vllm_evict.policies.base import Policy

__all__ = ["SERVER_OPTIONS", "Reservation", "refusal", "server_reservation"]


@dataclass(frozen=True)
class Reservation:
    states: frozenset[str]  # per-token fp32 states reserved, by name (union of policy.state_names)
    head_states: frozenset[str]  # per-token states with a per-query-head axis (policy.head_state_names)
    max_window: int  # the widest query window any request may use
    # A query ring of max_window per running request, on an elastic server (mode "elastic"): an elastic
    # request can be compressed at any step, with the latest queries of its window (``ServerConfig.ring``).
    ring: bool
    o_proj: bool = False  # every attention layer's output projection is loaded (a reserved method needs it)
    elastic: bool = False  # the server runs in elastic mode: requests may too (they need its ring and its scheduler)


def _head_states(policy: Policy) -> tuple[str, ...]:
    return tuple(getattr(policy, "head_state_names", ()) or ())


def _spec_policies(spec: str) -> list[Policy]:
    """A method with its default options and with each option set under which it keeps other states
    (``Policy.state_variants`` of the method and, for a meta score, of its base)."""
    meta, base = parse_spec(spec)
    default = build_policy(meta, base, {})
    variants = [*type(default).state_variants, *(type(default.base).state_variants if meta else ())]
    policies = [default]
    for options in variants:
        try:
            policies.append(build_policy(meta, base, options))
        except ValueError:  # an option this combination refuses (e.g. caote_mode 'head' over knorm)
            continue
    return policies


def server_reservation(server: ServerConfig) -> Reservation:
    """The states, window and weights a server reserves: those of its own method as configured, and of
    every method in its ``request_policies`` with any of its options (``Policy.state_variants``)."""
    policies = [server.eviction.build_policy(window_cap=server.max_window)]
    policies += [p for spec in server.request_policies for p in _spec_policies(spec)]
    return Reservation(
        states=frozenset(name for p in policies for name in p.state_names),
        head_states=frozenset(name for p in policies for name in _head_states(p)),
        max_window=server.max_window,
        ring=server.ring,
        o_proj=any(p.needs_o_proj for p in policies),
        elastic=server.eviction.elastic)


def _add_to_request_policies(spec: str) -> str:
    example = json.dumps({"request_policies": [spec]})
    return f"add '{spec}' to the server's request_policies (--kv-eviction-config '{example}')"


def refusal(config: EvictionConfig, reservation: Reservation) -> str | None:
    """Why a server with ``reservation`` cannot serve ``config`` (a message naming the server option to
    change), or None when it can."""
    if config.elastic and not reservation.elastic:
        return ("mode 'elastic' needs a server started in elastic mode, and this server's mode is 'fixed'; "
                "drop mode from the request, or start the server with --kv-eviction-config '{\"mode\": \"elastic\"}'")
    policy = config.build_policy(window_cap=reservation.max_window)
    spec = config.policy
    if policy.needs_o_proj and not reservation.o_proj:
        return (f"{spec} needs each attention layer's output projection (o_proj), which this server did not "
                f"load at start-up; {_add_to_request_policies(spec)} (it then checks at start-up that the "
                f"model has one), or choose a method without criticalkv")
    for name in _head_states(policy):
        if name not in reservation.head_states:
            return (f"{spec} needs the per-query-head token state '{name}', which this server did not reserve "
                    f"at start-up; {_add_to_request_policies(spec)}, or choose another method")
    for name in policy.state_names:
        if name not in reservation.states and name not in reservation.head_states:
            return (f"{spec} needs the per-token state '{name}', which this server did not reserve at "
                    f"start-up; {_add_to_request_policies(spec)}, or choose another method")
    for what, width in window_widths(config, policy).items():
        if width > reservation.max_window:
            return (f"{what} must be at most the server's max_window, {reservation.max_window} queries, got "
                    f"{width}; lower it, or start the server with a larger max_window (--kv-eviction-config "
                    f"'{{\"max_window\": {width}}}')")
    return None
