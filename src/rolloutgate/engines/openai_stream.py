"""Running one OpenAI-shaped call (`/v1/chat/completions`, `/v1/completions`) against any engine family.

Theory of operation: the adapter decides the body (family extensions such as SGLang's `rid`) and headers;
this module asks for a stream with a usage frame, reads it as `UpstreamEvent`s with cheap token counts
(engines/progress.py), and turns mid-stream error events into UpstreamError. A call the engine cannot stream
runs as one non-streamed request and yields a single `is_whole_body` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson

from rolloutgate.engines.base import AssemblyHint, UpstreamError, UpstreamEvent
from rolloutgate.engines.http import (
    ControlTimeouts,
    check_json_object,
    is_error_frame,
    iter_sse_data,
    map_exceptions,
    post_generation,
    raise_for_error_frame,
    raise_for_status,
)
from rolloutgate.engines.progress import ChunkCounter, whole_body_tokens
from rolloutgate.engines.upstream import UpstreamPool

__all__ = (
    "client_wants_usage",
    "generate_unsupported",
    "run_openai_call",
    "streaming_body",
    "whole_body_event",
)


def client_wants_usage(body: Mapping[str, Any]) -> bool:
    """True if a streaming client asked for the usage frame itself."""
    options = body.get("stream_options")
    return bool(body.get("stream")) and isinstance(options, dict) and bool(options.get("include_usage"))


def streaming_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the client's body that streams and ends with a usage frame (the client's other
    `stream_options` are kept)."""
    rewritten = dict(body)
    rewritten["stream"] = True
    options = body.get("stream_options")
    rewritten["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return rewritten


async def run_openai_call(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    *,
    headers: Mapping[str, str],
    timeouts: ControlTimeouts,
    hint: AssemblyHint,
    wants_usage: bool,
    upstream: UpstreamPool | None = None,
) -> AsyncIterator[UpstreamEvent]:
    """POST `body` to `url` and yield its events (or one whole-body event if the engine did not stream).

    Raises UpstreamError for connection failures, non-2xx answers, error events, unreadable or truncated
    streams. Closing the iterator early closes the upstream connection (vLLM aborts the request on that).
    `upstream`: the engine's lean keep-alive pool (engines/upstream.py); aiohttp's `session` without one.
    """
    what = f"POST {url}"
    with map_exceptions(what):
        async with post_generation(
            session, upstream, url, orjson.dumps(body), headers=headers, timeouts=timeouts
        ) as resp:
            await raise_for_status(resp, what=what)
            if resp.content_type != "text/event-stream":
                yield whole_body_event(await resp.read(), hint=hint)
                return
            completed = False
            try:
                counter = ChunkCounter()
                async for data in iter_sse_data(resp):
                    check_json_object(data)
                    if is_error_frame(data):
                        raise_for_error_frame(data)
                    tokens, is_usage, finish = counter.observe(data)
                    yield UpstreamEvent(
                        data=data,
                        tokens=tokens,
                        is_gateway_only=is_usage and not wants_usage,
                        finish_reason=finish,
                        assembly=hint,
                    )
                completed = True
            finally:
                if not completed:
                    resp.close()  # never reuse a half-read connection; closing it is vLLM's abort


def whole_body_event(body: bytes, *, hint: AssemblyHint) -> UpstreamEvent:
    """The single event of a non-streamed answer. Raises UpstreamError for an unreadable body or an error
    object (some servers answer errors with HTTP 200)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(
            f"the engine's answer is not JSON: {exc}", retryable=True, body=body[:4096]
        ) from exc
    if isinstance(parsed, dict) and "error" in parsed and is_error_frame(body.lstrip()):
        raise_for_error_frame(body.lstrip())
    return UpstreamEvent(
        data=body,
        tokens=whole_body_tokens(body),
        is_whole_body=True,
        finish_reason=_first_finish_reason(parsed),
        assembly=hint,
        _parsed=parsed,
    )


def _first_finish_reason(parsed: Any) -> str | None:
    item = parsed[0] if isinstance(parsed, list) and parsed else parsed
    if not isinstance(item, dict):
        return None
    choices = item.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    meta = item.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("finish_reason"), dict):
        reason = meta["finish_reason"].get("type")
        return reason if isinstance(reason, str) else None
    return None


def generate_unsupported(family: str) -> AsyncIterator[UpstreamEvent]:
    """Fail a `/generate` call on an engine without that route (non-retryable 400, OpenAI error body),
    on the first iteration and before anything is sent."""
    message = f"{family} has no /generate route; use /v1/completions or /v1/chat/completions"
    body = orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}}
    )
    return _Failing(UpstreamError(message, retryable=False, status=400, body=body))


class _Failing:
    """An async iterator whose first step raises."""

    __slots__ = ("_error",)

    def __init__(self, error: UpstreamError) -> None:
        self._error = error

    def __aiter__(self) -> _Failing:
        return self

    async def __anext__(self) -> UpstreamEvent:
        raise self._error
