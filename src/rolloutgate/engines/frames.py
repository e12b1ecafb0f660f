"""The gateway's own SSE frames and OpenAI-shaped error objects.

Theory of operation: engine events are forwarded as `sse_event(event.data)`; keep-alive is an SSE comment,
which every SSE client ignores; an error after the stream started is a `data: {"error": {...}}` event,
which the OpenAI SDK raises as `APIError` and LiteLLM as `MidStreamFallbackError` (reference/clients.md).
"""

from __future__ import annotations

import orjson

__all__ = ("SSE_DONE", "error_body", "error_frame", "error_object", "sse_comment", "sse_event")

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: bytes) -> bytes:
    """One SSE event carrying `data` (several `data:` lines if it has line breaks)."""
    if b"\n" in data or b"\r" in data:
        lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return b"data: " + data + b"\n\n"


def sse_comment(text: str = "keep-alive") -> bytes:
    """An SSE comment line (`: text`), ignored by clients; line breaks in `text` become spaces."""
    return b": " + text.replace("\r", " ").replace("\n", " ").encode() + b"\n\n"


def error_object(
    message: str, *, err_type: str = "server_error", code: int | str | None = 500, param: str | None = None
) -> dict[str, object]:
    """`{"error": {...}}` as OpenAI renders it (`message`, `type`, `param`, `code`)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_body(
    message: str, *, err_type: str = "server_error", code: int | str | None = 500, param: str | None = None
) -> bytes:
    """An OpenAI error as a JSON body."""
    return orjson.dumps(error_object(message, err_type=err_type, code=code, param=param))


def error_frame(
    message: str, *, err_type: str = "server_error", code: int | str | None = 500, param: str | None = None
) -> bytes:
    """An OpenAI error as an SSE event, for a stream that already started."""
    return sse_event(error_body(message, err_type=err_type, code=code, param=param))
