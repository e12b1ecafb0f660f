"""One generation call, its events pulled (`async for`) or pushed (a callback per event, as the socket reads).

Theory of operation: every adapter sends a generation the same way (a POST through the engine's lean pool or
aiohttp, a 2xx check, an SSE stream or one whole body) and differs only in how an SSE event becomes an
`UpstreamEvent`: that is its decoder (`GenerateDecoder` for SGLang's cumulative `/generate` chunks,
`OpenAIDecoder` for chat and completions chunks). The call then runs one of two ways:

- pulled, `pull_generation(...)`: an async iterator of events (`EngineClient.generate`), read in batches of
  one socket read each (`SseEvents`);
- pushed, `push_generation(..., on_events)`: the events of each socket read go to `on_events` together,
  synchronously, from the read that completed them (`UpstreamResponse.push`), with no task switch and no
  async iterator per event. This is the driver's path (`deliver`): at RL scale (thousands of streams, an
  event per stream every second or so) every event is a socket read of its own, and the pulled path's
  wake-up and frame switches were most of the gateway's CPU per event (docs/benchmarks.md); a streaming
  client's tokens, one event each, arrive several to a read, and the driver reports them to the core once
  per read. `on_events` returning False stops the call: the connection is closed (the engine's abort, as
  when a pulled iterator is closed early). Through aiohttp (no lean pool) the push is emulated with batches.

Both raise UpstreamError for connection failures, non-2xx answers, error events, unreadable or truncated
streams (`map_exceptions`); cancellation closes the connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from rolloutgate.engines.base import AssemblyHint, UpstreamCall, UpstreamError, UpstreamEvent
from rolloutgate.engines.http import (
    DONE,
    ControlTimeouts,
    SseEvents,
    SseParser,
    check_json_object,
    drain_after_done,
    is_error_frame,
    map_exceptions,
    post_generation,
    raise_for_error_frame,
    raise_for_status,
)
from rolloutgate.engines.progress import (
    ChunkCounter,
    CumulativeCounter,
    last_finish_reason_of,
    whole_body_tokens,
)
from rolloutgate.engines.upstream import UpstreamPool, UpstreamResponse

__all__ = (
    "EventDecoder",
    "EventSink",
    "GenerateDecoder",
    "OpenAIDecoder",
    "SsePush",
    "deliver",
    "finish_answer",
    "pull_generation",
    "pull_into",
    "push_generation",
    "whole_body_event",
)

# The events of one read, in order -> keep going (False: stop the call). Never called with an empty list.
EventSink = Callable[[list[UpstreamEvent]], bool]


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


async def pull_generation(
    session: aiohttp.ClientSession,
    upstream: UpstreamPool | None,
    url: str,
    body: bytes,
    *,
    headers: Mapping[str, str],
    timeouts: ControlTimeouts,
    decoder: EventDecoder,
) -> AsyncIterator[UpstreamEvent]:
    """The call's events (or one whole-body event if the engine did not stream). Closing the iterator early
    closes the upstream connection (vLLM aborts the request on that)."""
    what = f"POST {url}"
    post = post_generation(session, upstream, url, body, headers=headers, timeouts=timeouts)
    del body  # not kept for the answer's lifetime (a 100K-token prompt is ~600 KB; the pool drops its copy)
    with map_exceptions(what):
        async with post as resp:
            await raise_for_status(resp, what=what)
            if resp.content_type != "text/event-stream":
                yield whole_body_event(await resp.read(), hint=decoder.hint)
                return
            completed = False
            try:
                events = SseEvents(resp)
                while batch := await events.next_batch():
                    for data in batch:
                        yield decoder.decode(data)
                completed = True
            finally:
                if not completed:
                    resp.close()  # never reuse a half-read connection; closing it is vLLM's abort


async def push_generation(
    session: aiohttp.ClientSession,
    upstream: UpstreamPool | None,
    url: str,
    body: bytes,
    *,
    headers: Mapping[str, str],
    timeouts: ControlTimeouts,
    decoder: EventDecoder,
    on_events: EventSink,
) -> None:
    """Run the call, handing the events of each read to `on_events` as they arrive; returns after the last
    one, or as soon as `on_events` returns False (the connection is closed then).

    One coroutine frame for the whole call (no context-manager or helper frames): it is held for as long as
    the generation runs, by every stream in flight (docs/benchmarks.md, memory per stream)."""
    what = f"POST {url}"
    sink = SsePush(decoder, on_events)
    # The lean pool pushes a 200 event stream to the sink from the read of its headers on: one wake-up of
    # this task per answer (upstream_wire.py); any other answer comes back unread, as without it.
    post = post_generation(session, upstream, url, body, headers=headers, timeouts=timeouts, push_to=sink)
    del body  # not kept for the answer's lifetime (a 100K-token prompt is ~600 KB; the pool drops its copy)
    with map_exceptions(what):
        async with post as resp:
            await finish_answer(resp, what, sink, decoder, on_events)


async def finish_answer(
    resp: Any, what: str, sink: SsePush, decoder: EventDecoder, on_events: EventSink
) -> None:
    """Everything of a pushed call after its headers: the push (unless the lean pool already pushed the
    whole stream), the drain after `[DONE]`, the verdict on a stream that ended without it; a whole JSON body
    or an error status as such. Call inside `map_exceptions`."""
    if isinstance(resp, UpstreamResponse) and resp.pushed:
        resp.stop_push()
    else:
        await raise_for_status(resp, what=what)
        if resp.content_type != "text/event-stream":
            on_events([whole_body_event(await resp.read(), hint=decoder.hint)])
            return
        if not isinstance(resp, UpstreamResponse):
            await _push_batches(resp, decoder, on_events)
            return
        try:
            await resp.start_push(sink)
        finally:
            resp.stop_push()
    if sink.saw_done:
        await drain_after_done(resp)  # normally only the chunked terminator, often already read
        return
    if sink.stopped:
        resp.close()
        return
    error = sink.end_error()
    if error is not None:
        raise error


async def _push_batches(resp: Any, decoder: EventDecoder, on_events: EventSink) -> None:
    """Push emulated over a response that cannot push (aiohttp's): batches of one read each."""
    events = SseEvents(resp)
    while batch := await events.next_batch():
        if not _hand_over(batch, decoder, on_events)[1]:
            resp.close()
            return


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
            return UpstreamError("the engine's stream ended inside an event", retryable=True)
        return UpstreamError("the engine's stream ended before [DONE]", retryable=True)


async def pull_into(events: AsyncIterator[UpstreamEvent], on_events: EventSink) -> None:
    """Hand the events of a pulled call to `on_events` one by one, closing the iterator when it returns
    False."""
    try:
        async for event in events:
            if not on_events([event]):
                return
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def deliver(client: Any, call: UpstreamCall, on_events: EventSink) -> Awaitable[None]:
    """Run `call` on an engine client, handing its events to `on_events`: pushed a read at a time where the
    client can (`stream_into(call, on_events)`), else pulled from `generate(call)`. The awaitable raises
    UpstreamError."""
    push = getattr(client, "stream_into", None)
    if push is not None:
        return push(call, on_events)  # type: ignore[no-any-return]
    return pull_into(client.generate(call), on_events)


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
