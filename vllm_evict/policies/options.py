"""Validators for policy options: each raises ValueError with a message that names the option, its
allowed range and (a short form of) the value it got.

The static bounds here hold wherever a config is built (engine, reference runner, tests); an engine
adds its own on top (``max_model_len``, the server's ``max_window``: see ``vllm_evict.reservation``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

MAX_TOKENS = 2**31 - 1  # token counts (budget, slack, windows, sinks): positions are int32 in the engine
MAX_SEED = 2**63 - 1  # seeds are int64 in the engine
MAX_KERNEL = 31  # pooling kernels: a few neighbours smooth a score; wider ones only cost time
SHOWN_CHARS = 64  # a bad value is echoed back at most this long


def show(value: Any) -> str:
    """A short, safe description of ``value`` for an error message: never megabytes, never a deep repr
    (containers are named by type and size), never an int too long to print."""
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        if abs(value) < 10**30:
            return repr(value)
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        if len(value) <= SHOWN_CHARS:
            return repr(value)
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"a {'JSON object' if isinstance(value, dict) else 'list'} of {len(value)} entries"
    return f"a {type(value).__name__}"


def check_int(name: str, value: Any, minimum: int = 0, maximum: int = MAX_TOKENS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer in [{minimum}, {maximum}], got {show(value)}")
    return value


def check_odd_kernel(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_KERNEL or value % 2 == 0:
        raise ValueError(f"{name} must be an odd integer in [1, {MAX_KERNEL}] (pooling keeps the length), "
                         f"got {show(value)}")
    return value


def check_float(name: str, value: Any, low: float, high: float, low_open: bool = False,
                high_open: bool = False) -> float:
    """A finite number in [low, high] (open at either end when asked); ints are accepted."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in {interval}, got {show(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float range
        v = math.inf
    if (not math.isfinite(v) or v < low or v > high or (low_open and v == low) or (high_open and v == high)):
        raise ValueError(f"{name} must be a number in {interval}, got {show(value)}")
    return v


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {show(value)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {show(value)}")
    return value
