"""A generation's wire and its events: what `start_generation` (engines/push_call.py) runs for every adapter.

Theory of operation: every adapter sends a generation the same way (a POST on the engine's keep-alive pool,
engines/upstream.py; a 2xx check; an SSE stream or one whole body) and differs only in the body it sends and
in how an SSE event becomes an `UpstreamEvent`: that is its decoder (`GenerateDecoder` for SGLang's cumulative
`/generate` chunks, `OpenAIDecoder` for chat and completions chunks). The events of each socket read go to
`on_events` together, synchronously, from the read that completed them (no task switch, no async iterator
per event); `on_events` returning False stops the call and closes the connection (how an engine learns its
client left). The outcome goes to `on_end` once: None when the answer ended well, else the UpstreamError.

Two ways to carry it, one behaviour (engines/push_call.py `start_generation` chooses): on an idle keep-alive
connection the call needs no task (the connection's callbacks carry it); otherwise a task connects, sends and
pushes (`push_generation`).

Errors are UpstreamError for connection failures, non-2xx answers, error events, unreadable or truncated
streams (`map_exceptions`); cancelling the handle closes the connection and reports nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from rolloutgate.engines.base import (
    AssemblyHint,
    EndSink,
    EventSink,
    UpstreamError,
    UpstreamEvent,
    UpstreamHandle,
)
from rolloutgate.engines.http import (
    DONE,
    DRAIN_AFTER_DONE_S,
    MAX_ERROR_BODY,
    SseParser,
    check_json_object,
    generation_headers,
    is_error_frame,
    map_exceptions,
    raise_for_error_frame,
    status_error,
)
from rolloutgate.engines.progress import (
    ChunkCounter,
    CumulativeCounter,
    last_finish_reason_of,
    whole_body_tokens,
)
from rolloutgate.engines.upstream import UpstreamAnswer, UpstreamPool

__all__ = (
    "EndSink",
    "EventDecoder",
    "EventSink",
    "GenerateDecoder",
    "OpenAIDecoder",
    "SsePush",
    "UpstreamHandle",
    "finish_answer",
    "push_generation",
    "refuse",
    "whole_body_event",
)


class EventDecoder(Protocol):
    hint: AssemblyHint

    def decode(self, data: bytes) -> UpstreamEvent:
        """The event of one SSE data payload. Raises UpstreamError for an error event or a non-object."""
        ...


class GenerateDecoder:
    """SGLang `/generate` chunks: cumulative, counted by `meta_info.completion_tokens` deltas."""

    __slots__ = ("_counter", "hint")

    def __init__(self, hint: AssemblyHint) -> None:
        self.hint = hint
        self._counter = CumulativeCounter()

    def decode(self, data: bytes) -> UpstreamEvent:
        check_json_object(data)
        if is_error_frame(data):
            raise_for_error_frame(data)
        return UpstreamEvent(
            data=data,
            tokens=self._counter.tokens(data),
            finish_reason=last_finish_reason_of(data),
            assembly=self.hint,
        )


class OpenAIDecoder:
    """Chat and completions chunks; the usage frame the gateway asked for is gateway-only unless the client
    asked for it too (`wants_usage`)."""

    __slots__ = ("_counter", "_wants_usage", "hint")

    def __init__(self, hint: AssemblyHint, *, wants_usage: bool) -> None:
        self.hint = hint
        self._wants_usage = wants_usage
        self._counter = ChunkCounter()

    def decode(self, data: bytes) -> UpstreamEvent:
        check_json_object(data)
        if is_error_frame(data):
            raise_for_error_frame(data)
        tokens, is_usage, finish = self._counter.observe(data)
        return UpstreamEvent(
            data=data,
            tokens=tokens,
            is_gateway_only=is_usage and not self._wants_usage,
            finish_reason=finish,
            assembly=self.hint,
        )


async def push_generation(
    pool: UpstreamPool,
    path: str,
    body: bytes,
    *,
    headers: Mapping[str, str],
    connect_s: float,
    decoder: EventDecoder,
    on_events: EventSink,
) -> None:
    """Run the call, handing the events of each read to `on_events` as they arrive; returns after the last
    one, or as soon as `on_events` returns False (the connection is closed then).

    One coroutine frame for the whole call (no context-manager or helper frames): it is held for as long as
    the generation runs, by every stream in flight (docs/benchmarks.md, memory per stream)."""
    what = f"POST {pool.base_url}{path}"
    sink = SsePush(decoder, on_events)
    # The pool pushes a 200 event stream to the sink from the read of its headers on: one wake-up of this
    # task per answer (upstream_wire.py); any other answer comes back unread.
    post = pool.post(path, body, generation_headers(headers), connect_timeout=connect_s, push_to=sink)
    del body  # not kept for the answer's lifetime (a 100K-token prompt is ~600 KB; the pool drops its copy)
    with map_exceptions(what):
        async with post as resp:
            await finish_answer(resp, what, sink, decoder, on_events)


async def finish_answer(
    resp: UpstreamAnswer, what: str, sink: SsePush, decoder: EventDecoder, on_events: EventSink
) -> None:
    """Everything of a pushed call after its headers: the push (unless the pool already pushed the whole
    stream), the drain after `[DONE]`, the verdict on a stream that ended without it; a whole JSON body or an
    error status as such. Call inside `map_exceptions`."""
    if resp.pushed:
        resp.stop_push()
    else:
        if resp.status >= 300:
            raise status_error(resp.status, await resp.read(MAX_ERROR_BODY), what=what)
        if resp.content_type != "text/event-stream":
            on_events([whole_body_event(await resp.read(), hint=decoder.hint)])
            return
        try:
            await resp.start_push(sink)
        finally:
            resp.stop_push()
    if sink.saw_done:
        await resp.drain(DRAIN_AFTER_DONE_S)  # normally only the chunked terminator, often already read
        return
    if sink.stopped:
        resp.close()
        return
    error = sink.end_error()
    if error is not None:
        raise error


class _Refused:
    """The handle of a call refused before anything was sent: its error is reported from a loop callback."""

    __slots__ = ("_timer",)

    def __init__(self, error: UpstreamError, on_end: EndSink) -> None:
        self._timer: asyncio.Handle | None = asyncio.get_running_loop().call_soon(on_end, error)

    def done(self) -> bool:
        return self._timer is None or self._timer.cancelled()

    def cancel(self) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        return True


def refuse(error: UpstreamError, on_end: EndSink) -> UpstreamHandle:
    """A call the adapter will not send (e.g. `/generate` on an engine without it): `on_end(error)` soon."""
    return _Refused(error, on_end)


def _hand_over(payloads: list[bytes], decoder: EventDecoder, on_events: EventSink) -> tuple[bool, bool]:
    """Decode the payloads of one read and hand their events over together: (saw [DONE], keep going).

    Events after [DONE] are ignored. An event that cannot be decoded (an error event, a non-object) raises,
    after the events before it were handed over, as they were when each went over alone."""
    events: list[UpstreamEvent] = []
    saw_done = False
    try:
        for data in payloads:
            if data == DONE:
                saw_done = True
                break
            events.append(decoder.decode(data))
    except UpstreamError:
        if events:
            on_events(events)
        raise
    keep_going = on_events(events) if events else True
    return saw_done, keep_going


class SsePush:
    """The sink of a pushed SSE body: parses each piece and hands its decoded events over together."""

    __slots__ = ("_decoder", "_on_events", "_parser", "saw_done", "stopped")

    def __init__(self, decoder: EventDecoder, on_events: EventSink) -> None:
        self._decoder = decoder
        self._on_events = on_events
        self._parser = SseParser()
        self.saw_done = False
        self.stopped = False

    def __call__(self, piece: bytes) -> bool:
        payloads = self._parser.feed(piece)
        if not payloads:
            return True
        saw_done, keep_going = _hand_over(payloads, self._decoder, self._on_events)
        if not keep_going:
            self.stopped = True
            return False
        if saw_done:
            self.saw_done = True
            return False
        return True

    def end_error(self) -> UpstreamError | None:
        """The verdict on a stream that ended without `[DONE]` and was not stopped: None when its last bytes
        were a `[DONE]` without the blank line after it, else the error."""
        tail = self._parser.finish()
        if tail == DONE:
            return None
        if tail is not None:
            return UpstreamError("the engine's stream ended inside an event", retryable=True, lost=True)
        return UpstreamError("the engine's stream ended before [DONE]", retryable=True, lost=True)


def whole_body_event(body: bytes, *, hint: AssemblyHint) -> UpstreamEvent:
    """The single event of a non-streamed answer. Raises UpstreamError for an unreadable body or an error
    object (some servers answer errors with HTTP 200).

    The answer is parsed once, for its check, token count and finish reason, and the parsed tree is not
    kept on the event: the event's bytes go to the client as they are, and parsed, a long answer is several
    times its size (a 32K-token answer with logprobs ~4x). `UpstreamEvent.json()` parses again, lazily, for
    a reader that needs it."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(
            f"the engine's answer is not JSON: {exc}", retryable=True, body=body[:4096]
        ) from exc
    if isinstance(parsed, dict) and "error" in parsed and is_error_frame(body.lstrip()):
        raise_for_error_frame(body.lstrip())
    tokens = whole_body_tokens(parsed)
    finish_reason = _first_finish_reason(parsed)
    del parsed
    return UpstreamEvent(
        data=body,
        tokens=tokens,
        is_whole_body=True,
        finish_reason=finish_reason,
        assembly=hint,
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
