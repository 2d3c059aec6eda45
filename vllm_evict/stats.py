"""Per-request eviction stats, as the client that sent the request sees them.

The engine core reports them in the request's ``kv_transfer_params`` under the key ``"kv_eviction"``:
that dict is the one free-form, per-request field vLLM carries from the engine core to the output
processor (``EngineCoreOutput.kv_transfer_params``), onto ``RequestOutput.kv_transfer_params``, and into
the OpenAI responses (top level of the body; vLLM 0.33 also puts it on the final streamed chunk, and
``vllm_evict.openai_server`` does the same on 0.32). See docs/observability.md.

This module imports nothing from vLLM: clients can use it on a parsed JSON response too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

KEY = "kv_eviction"  # key inside kv_transfer_params
# Key inside the kv_transfer_params of a request the engine refused at intake (finish reason "error"):
# why, for a request that did not come through this plugin's front end (which refuses with HTTP 400).
REFUSED_KEY = "kv_eviction_refused"
POLICY_NONE = "none"  # the policy label of a request served with eviction turned off


@dataclass(frozen=True)
class RequestEvictionStats:
    """What eviction did to one request (one sequence: each of ``n`` choices is its own request).

    Token counts are per sequence: every layer and KV head keeps the same number of tokens.
    ``tokens_evicted`` and ``pages_freed`` add up over the request's life, recomputation after a
    preemption included; without preemption ``tokens_evicted == logical tokens - tokens_cached``.
    """

    policy: str  # policy actually applied, after per-request overrides; "none" when eviction was off
    budget: int | None  # tokens kept per layer and KV head; None when eviction was off
    tokens_evicted: int  # tokens dropped from the cache by eviction
    tokens_cached: int  # tokens physically cached when the stats were taken (at the end: in the final cache)
    peak_tokens_cached: int  # most tokens the request held in cache at any step
    pages_freed: int  # KV pages eviction gave back to the block pool while the request ran

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestEvictionStats":
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise ValueError(f"eviction stats without {', '.join(missing)}: {dict(data)!r}")
        return cls(**{n: data[n] for n in names})


def refusal_reason(output: Any) -> str | None:
    """Why the engine refused a request (a ``RequestOutput`` or a parsed response), or None."""
    params = output.get("kv_transfer_params") if isinstance(output, Mapping) else getattr(
        output, "kv_transfer_params", None)
    reason = params.get(REFUSED_KEY) if isinstance(params, Mapping) else None
    return reason if isinstance(reason, str) else None


def eviction_stats(output: Any) -> RequestEvictionStats | None:
    """The eviction stats of a ``RequestOutput``, or of a parsed OpenAI response / final stream chunk
    (a dict); None when the server runs without eviction (or the object carries none)."""
    params = output.get("kv_transfer_params") if isinstance(output, Mapping) else getattr(
        output, "kv_transfer_params", None)
    if not isinstance(params, Mapping) or KEY not in params:
        return None
    return RequestEvictionStats.from_dict(params[KEY])
