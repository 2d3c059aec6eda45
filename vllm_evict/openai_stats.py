"""Per-request eviction stats in streamed OpenAI responses.

The stats travel in the request's ``kv_transfer_params`` (see ``vllm_evict.stats``). vLLM returns that
field at the top level of non-streamed completion and chat responses, and vLLM 0.33 also on the streamed
chunk that carries a choice's ``finish_reason``. vLLM 0.32 leaves it out of streams; the wrappers here add
it to that same chunk, in the same place, so a client reads the stats the same way on both versions. A
chunk that already has ``kv_transfer_params`` (vLLM 0.33) is left as it is.

Headers are not an option: a streamed response sends them before the first token, long before the stats
are known.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, AsyncIterator, Callable

from vllm_evict.stats import KEY

_MARK = "_vllm_evict_stream_stats"


def install() -> None:
    """Wrap the completion and chat stream generators of the OpenAI server (idempotent)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap(OpenAIServingCompletion, "completion_stream_generator", yields_prompt_index=True)
    _wrap(OpenAIServingChat, "chat_completion_stream_generator", yields_prompt_index=False)


def _wrap(cls: type, name: str, *, yields_prompt_index: bool) -> None:
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    async def stream_with_stats(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(self, *args, **kwargs)
        finished: dict[int, dict[str, Any]] = {}  # choice index -> kv_transfer_params of its last output
        choices_per_prompt = getattr(bound.arguments["request"], "n", None) or 1
        bound.arguments["result_generator"] = _watch(
            bound.arguments["result_generator"], finished, choices_per_prompt if yields_prompt_index else None)
        async for chunk in original(*bound.args, **bound.kwargs):
            yield _with_stats(chunk, finished) if finished else chunk

    setattr(stream_with_stats, _MARK, True)
    stream_with_stats.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, stream_with_stats)


async def _watch(results: AsyncIterator[Any], finished: dict[int, dict[str, Any]],
                 choices_per_prompt: int | None) -> AsyncIterator[Any]:
    """Pass the engine's outputs through, noting the stats of every choice that finishes."""
    async for item in results:
        prompt_index, output = item if choices_per_prompt is not None else (0, item)
        params = output.kv_transfer_params
        done = [c.index for c in output.outputs if c.finish_reason is not None]
        # With n > 1, vLLM may merge several choices' outputs into one, with the kv_transfer_params of
        # the last: they belong to a choice only when it is the only one finishing in this output.
        if isinstance(params, dict) and KEY in params and len(done) == 1:
            finished[done[0] + prompt_index * (choices_per_prompt or 1)] = params
        yield item


def _with_stats(chunk: str, finished: dict[int, dict[str, Any]]) -> str:
    """The SSE chunk with ``kv_transfer_params`` added when it finishes a choice whose stats are known."""
    prefix = "data: "
    if not chunk.startswith(prefix + "{"):
        return chunk
    body = json.loads(chunk[len(prefix):])
    params = None
    for choice in body.get("choices") or ():
        if choice.get("finish_reason") is not None and choice.get("index") in finished:
            params = finished.pop(choice["index"])
    if params is None or body.get("kv_transfer_params") is not None:
        return chunk
    body["kv_transfer_params"] = params
    return f"{prefix}{json.dumps(body, separators=(',', ':'))}\n\n"


def is_installed(method: Callable[..., Any]) -> bool:
    return bool(getattr(method, _MARK, False))
