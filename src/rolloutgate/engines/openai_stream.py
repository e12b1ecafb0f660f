"""Running one OpenAI-shaped call (`/v1/chat/completions`, `/v1/completions`) against any engine family.

Theory of operation: the adapter decides the body (family extensions such as SGLang's `rid`) and headers;
this module asks for a stream with a usage frame, reads it as `UpstreamEvent`s with cheap token counts
(engines/progress.py), and turns mid-stream error events into UpstreamError. A call the engine cannot stream
runs as one non-streamed request and yields a single `is_whole_body` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

import aiohttp
import orjson

from rolloutgate.engines.base import AssemblyHint, UpstreamError, UpstreamEvent
from rolloutgate.engines.generation import (
    EventSink,
    OpenAIDecoder,
    pull_generation,
    push_generation,
    whole_body_event,
)
from rolloutgate.engines.http import ControlTimeouts
from rolloutgate.engines.upstream import UpstreamPool

__all__ = (
    "client_wants_usage",
    "generate_unsupported",
    "push_openai_call",
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


def run_openai_call(
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
    return pull_generation(
        session,
        upstream,
        url,
        orjson.dumps(body),
        headers=headers,
        timeouts=timeouts,
        decoder=OpenAIDecoder(hint, wants_usage=wants_usage),
    )


def push_openai_call(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    on_events: EventSink,
    *,
    headers: Mapping[str, str],
    timeouts: ControlTimeouts,
    hint: AssemblyHint,
    wants_usage: bool,
    upstream: UpstreamPool | None = None,
) -> Awaitable[None]:
    """`run_openai_call`, its events handed to `on_events` a read at a time (engines/generation.py)."""
    return push_generation(
        session,
        upstream,
        url,
        orjson.dumps(body),
        headers=headers,
        timeouts=timeouts,
        decoder=OpenAIDecoder(hint, wants_usage=wants_usage),
        on_events=on_events,
    )


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
