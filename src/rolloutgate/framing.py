"""The bytes of an answer that keep-alive committed as a 200 before it was known: keep-alive itself, and an
error that every client still raises on, once, without retrying.

Measured per client (docs/clients.md): a stream gets an SSE `data: {"error": ...}` event (the OpenAI SDK
raises APIError, LiteLLM raises); a non-streaming body gets the error object followed by a second JSON
value, so the body is not valid JSON (the OpenAI SDK raises a JSONDecodeError, LiteLLM an
InternalServerError, an httpx user's `.json()` raises), the error object still first in it. A bare
`{"error": ...}` is returned by the SDK as a completion with no choices; cutting the connection makes the
SDK and LiteLLM retry, which starts new generations. Used by the front (server/respond.py) and the session
API (server/session_routes.py, through the same writer) alike.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

__all__ = (
    "ERROR_TRAILER",
    "JSON_KEEPALIVE",
    "NOT_FORWARDED",
    "SSE_DONE",
    "SSE_KEEPALIVE",
    "error_after_keepalive",
    "error_event",
    "forwardable",
)

SSE_KEEPALIVE = b": keep-alive\n\n"
JSON_KEEPALIVE = b" "  # JSON allows leading whitespace: httpx, the OpenAI SDK and LiteLLM parse it
SSE_DONE = b"data: [DONE]\n\n"
ERROR_TRAILER = b'\n{"rolloutgate": "error after keep-alive: the error object above is the answer"}\n'

# Headers a proxy hop does not pass on, either way: the hop-by-hop ones (RFC 9110 7.6.1), Host, and the body's
# framing, which the hop re-frames (aiohttp de-chunks and decompresses what it reads, so a passed-on
# Content-Length or Content-Encoding would describe another body).
NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)


def forwardable(headers: Mapping[str, str], *, to_engine: bool) -> dict[str, str]:
    """The headers a hop passes on; toward an engine not the client's `Authorization` (the gateway's key)."""
    return {
        k: v
        for k, v in headers.items()
        if k.lower() not in NOT_FORWARDED and not (to_engine and k.lower() == "authorization")
    }


def error_after_keepalive(error_body: bytes, *, streams: bool, status: int) -> bytes:
    """What ends a committed answer with an error (`error_body`: a JSON error, the gateway's or an engine's)."""
    if streams:
        return b"data: " + error_event(error_body, status) + b"\n\n" + SSE_DONE
    return error_body + ERROR_TRAILER


def error_event(body: bytes, status: int) -> bytes:
    """An SSE error payload with a top-level `error` key (the OpenAI SDK raises only on that shape)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and "error" in value:
        return body
    message = value.get("message") if isinstance(value, dict) else body.decode("utf-8", "replace")
    return orjson.dumps(
        {"error": {"message": str(message), "type": "upstream_error", "param": None, "code": status}}
    )
