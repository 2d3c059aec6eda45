"""The OpenAI server's side of eviction: refusing bad settings before a stream starts, and the
per-request eviction stats in streamed responses. Installed by the eviction stat logger
(``vllm_evict.metrics``), which vLLM creates in every API server process.

Bad settings. vLLM validates a request's parameters before it answers, so a bad one gets HTTP 400, except
what is only checked when the engine client admits the request: for a streamed request that happens after
the 200 and the first bytes are sent, and the refusal arrives as an error event in the stream. The
per-request eviction settings are checked here, in the request handler, so that a streamed request with
bad settings gets a real HTTP 400 too (with the same message as before). A request that could never fit
the KV pool is refused where the prompt's length is known, after tokenization, so a streamed one still
gets vLLM's error event (with code 400), as for a prompt longer than max_model_len.

Stats. The stats travel in the request's ``kv_transfer_params`` (see ``vllm_evict.stats``). vLLM returns that
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
from typing import Any, AsyncIterator

from vllm_evict.config import REQUEST_KEYS, resolve_request_config
from vllm_evict.guards import check_policy_supported
from vllm_evict.stats import KEY

_MARK = "_vllm_evict_openai_hook"


def install() -> None:
    """Wrap the completion and chat handlers of the OpenAI server (idempotent)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap_handler(OpenAIServingCompletion, "create_completion")
    _wrap_handler(OpenAIServingChat, "create_chat_completion")
    _wrap_stream(OpenAIServingCompletion, "completion_stream_generator", yields_prompt_index=True)
    _wrap_stream(OpenAIServingChat, "chat_completion_stream_generator", yields_prompt_index=False)


# ---- bad settings: HTTP 400 before any stream starts ----------------------------------------------
def settings_error(vllm_config: Any, xargs: Any) -> str | None:
    """The message refusing a request's eviction settings, or None when they are fine (or absent)."""
    if not isinstance(xargs, dict) or not any(key in xargs for key in REQUEST_KEYS):
        return None
    server = (getattr(vllm_config, "additional_config", None) or {}).get("kv_eviction")
    try:
        check_policy_supported(vllm_config, resolve_request_config(server, xargs))
    except ValueError as err:
        return str(err)
    return None


def _wrap_handler(cls: type, name: str) -> None:
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return

    async def handler(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        message = settings_error(self.engine_client.vllm_config, getattr(request, "vllm_xargs", None))
        if message is not None:
            from vllm_evict.metrics import record_rejection

            record_rejection("invalid_settings")
            return self.create_error_response(message)
        return await original(self, request, *args, **kwargs)

    setattr(handler, _MARK, True)
    handler.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, handler)


# ---- stats on the finishing chunk of a stream -------------------------------------------------------
def _wrap_stream(cls: type, name: str, *, yields_prompt_index: bool) -> None:
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
