"""The OpenAI-shaped call (`/v1/chat/completions`, `/v1/completions`) as any engine family gets it.

Theory of operation: the adapter decides the body's family extensions (SGLang's `rid`) and headers; this
module decides whether it streams. A streaming client's call streams with a usage frame (the events are read
with cheap token counts, engines/progress.py); any other call goes as it came and is answered as one whole
body (engines/generation.py `whole_body_event`), watched at engine level (core/engine_watch.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from rolloutgate.engines.base import UpstreamError

__all__ = ("client_wants_usage", "route_unsupported", "upstream_body")


def client_wants_usage(body: Mapping[str, Any]) -> bool:
    """True if a streaming client asked for the usage frame itself."""
    options = body.get("stream_options")
    return bool(body.get("stream")) and isinstance(options, dict) and bool(options.get("include_usage"))


def upstream_body(body: Mapping[str, Any], *, stream: bool | None = None) -> dict[str, Any]:
    """A copy of the client's body as it goes to the engine. A streaming client's call streams and ends with a
    usage frame (the client's other `stream_options` are kept); any other call is sent as it came and answered
    as one whole body: OpenAI chunks carry ~200 bytes of envelope per token, so streaming it to watch its
    progress would multiply the engine's output work (engine-level load watches it instead). `stream=True`:
    stream it whatever the client asked (an engine without a load signal: its events are the only one)."""
    rewritten = dict(body)
    if not (body.get("stream") if stream is None else stream):
        return rewritten
    rewritten["stream"] = True
    options = body.get("stream_options")
    rewritten["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return rewritten


def route_unsupported(family: str, route: str) -> UpstreamError:
    """The error of a call on an engine without its route (`/generate` on vLLM, vLLM's
    `/inference/v1/generate` on SGLang): a non-retryable 400 with an OpenAI body."""
    message = f"{family} has no {route} route; use /v1/completions or /v1/chat/completions"
    body = orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}}
    )
    return UpstreamError(message, retryable=False, status=400, body=body)
