"""Writing one exchange's outcome to its client: headers late, keep-alive while waiting, errors it recognises.

Theory of operation: the HTTP status is committed by the first byte written. So the writer waits, and only
when the client would otherwise hear nothing for a keep-alive interval does it send 200 headers and a
keep-alive byte: an SSE comment (`: keep-alive`) for a stream, a space before the JSON body otherwise (JSON
allows leading whitespace; httpx, the OpenAI SDK and LiteLLM all parse it, see reference/clients.md). An answer
or an error that comes before that gets its proper status and headers, timing included.

Once keep-alive has committed a 200, an error is framed so each client still raises once and none retries
(rolloutgate/framing.py, shared with the session API).

The interval is the server's `keepalive_interval`, shortened to half the client's announced read timeout
(`x-stainless-read-timeout`, sent by the OpenAI SDK and so by LiteLLM), and can be turned off or on per
request with `X-Rolloutgate-Keepalive: off|on`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import orjson
from aiohttp import web

from rolloutgate.errors import GatewayError
from rolloutgate.framing import JSON_KEEPALIVE, SSE_DONE, SSE_KEEPALIVE, error_after_keepalive
from rolloutgate.server.exchange import Finished, Outbox, OutboxItem
from rolloutgate.server.metrics import Metrics

__all__ = ("NO_TIMING", "Answering", "KeepAlive", "TimingSource", "keepalive_for", "write_outcome")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
JSON_HEADERS = {"Content-Type": "application/json"}
_MAX_EVENTS_PER_WRITE = 64  # stream events joined into one write when they are already queued


@dataclass(slots=True)  # not frozen: built per request (core/events.py, `_per_request`)
class KeepAlive:
    """When to write keep-alive bytes: every `interval_s` real seconds of silence; None = never."""

    interval_s: float | None


def keepalive_for(
    headers: object, *, streams: bool, interval_real_s: float, non_streaming_default: bool, enabled: bool
) -> KeepAlive:
    """The keep-alive policy of one request, from the server settings and the client's headers."""
    get = headers.get  # type: ignore[attr-defined]
    choice = (get("X-Rolloutgate-Keepalive") or "").lower()
    if not enabled or interval_real_s <= 0 or choice == "off":
        return KeepAlive(None)
    if not streams and not non_streaming_default and choice != "on":
        return KeepAlive(None)
    interval = interval_real_s
    announced = get("x-stainless-read-timeout")
    if announced:
        try:
            read_timeout = float(announced)
        except ValueError:
            read_timeout = 0.0
        if read_timeout > 0:
            interval = min(interval, read_timeout / 2)
    return KeepAlive(interval)


class Answering(Protocol):
    """What the writer reads and marks of the call it answers: an `Exchange`, or a session turn's reply
    (server/session_routes.py)."""

    request_id: str
    client_streams: bool
    engine_url: str | None
    committed: bool


class TimingSource(Protocol):
    def timing_header(self, request_id: str) -> str:
        """The request's live `X-Rolloutgate-Timing` value ("" once it is unknown)."""
        ...


class _NoTiming:
    def timing_header(self, request_id: str) -> str:
        return ""


NO_TIMING: TimingSource = _NoTiming()


async def write_outcome(
    request: web.Request,
    exchange: Answering,
    outbox: Outbox,
    keepalive: KeepAlive,
    metrics: Metrics,
    timing: TimingSource,
    answer_headers: Mapping[str, str] | None = None,
) -> web.StreamResponse:
    """Wait for the exchange's items and write them. Raises CancelledError if the client goes away.

    `timing` gives the timing header when headers go out before the answer (the driver; `NO_TIMING` for a
    replay): a shared object, not a closure per request, since every stream in flight holds this frame.
    `answer_headers`: more headers for the client, read when the headers go out (a session turn fills it
    before it hands over its answer)."""
    streams = exchange.client_streams
    response: web.StreamResponse | None = None
    wait = keepalive.interval_s
    pending: OutboxItem | None = None  # taken from the outbox while batching, not written yet
    while True:
        if pending is not None:
            item, pending = pending, None
        else:
            try:
                item = await outbox.get(wait)
            except TimeoutError:
                if response is None:
                    response = await _start(
                        request, streams, timing.timing_header(exchange.request_id), exchange, answer_headers
                    )
                keep = SSE_KEEPALIVE if streams else JSON_KEEPALIVE
                await response.write(keep)
                metrics.keepalive_bytes.labels(kind="sse" if streams else "json").inc(len(keep))
                continue

        if isinstance(item, bytes):
            if response is None:
                response = await _start(
                    request, streams, timing.timing_header(exchange.request_id), exchange, answer_headers
                )
            # Events already waiting go out in the same write: one chunk and one send instead of one each.
            frames = [b"data: ", item, b"\n\n"]
            while len(frames) < 3 * _MAX_EVENTS_PER_WRITE and not outbox.empty():
                following = outbox.get_nowait()
                if not isinstance(following, bytes):
                    pending = following
                    break
                frames += (b"data: ", following, b"\n\n")
            if isinstance(pending, Finished):  # the stream's end came with them: one write for both
                return await _write_finished(
                    request, exchange, response, pending, answer_headers, b"".join(frames)
                )
            await response.write(b"".join(frames))
        elif isinstance(item, Finished):
            return await _write_finished(request, exchange, response, item, answer_headers)
        else:
            return await _write_error(request, response, item, streams)


class _LateHeadersResponse(web.StreamResponse):
    """A StreamResponse whose headers go out with its first write (as `web.Response` sends them), not alone
    when prepared: `_start` is always followed by a write (events, keep-alive bytes or the end), so the
    client gets one send instead of two. aiohttp's own switch for this is the class attribute below."""

    _send_headers_immediately = False


async def _start(
    request: web.Request,
    streams: bool,
    timing_header: str,
    exchange: Answering,
    answer_headers: Mapping[str, str] | None,
) -> web.StreamResponse:
    headers = dict(SSE_HEADERS if streams else JSON_HEADERS)
    if answer_headers:
        headers.update(answer_headers)
    headers["X-Rolloutgate-Request-Id"] = exchange.request_id
    if timing_header:
        headers["X-Rolloutgate-Timing"] = timing_header  # as of the first byte; the final one is in the body
    if exchange.engine_url:
        headers["X-Rolloutgate-Engine"] = exchange.engine_url
    response = _LateHeadersResponse(status=200, headers=headers)
    await response.prepare(request)
    exchange.committed = True
    return response


async def _write_finished(
    request: web.Request,
    exchange: Answering,
    response: web.StreamResponse | None,
    item: Finished,
    answer_headers: Mapping[str, str] | None,
    events: bytes = b"",
) -> web.StreamResponse:
    """The end of a successful answer; `events`: stream events to write before it (framed already)."""
    timing = item.timing
    if exchange.client_streams:
        if response is None:
            exchange.engine_url = item.engine_url
            response = await _start(request, True, timing.header_value(), exchange, answer_headers)
        await response.write_eof(
            events + b": rolloutgate-timing " + timing.header_value().encode() + b"\n\n" + SSE_DONE
        )
        return response
    body = item.body if item.body is not None else b"{}"
    if response is None:
        headers = dict(JSON_HEADERS)
        if answer_headers:
            headers.update(answer_headers)
        headers["X-Rolloutgate-Timing"] = timing.header_value()
        headers["X-Rolloutgate-Request-Id"] = exchange.request_id
        if item.engine_url:
            headers["X-Rolloutgate-Engine"] = item.engine_url
        return web.Response(body=body, headers=headers)
    # Headers went out with keep-alive: the final breakdown travels in the body, as one more field.
    await response.write_eof(with_field(body, b"rolloutgate_timing", orjson.dumps(timing.as_dict())))
    return response


def with_field(body: bytes, name: bytes, value: bytes) -> bytes:
    """`body` (a JSON object) with one more field appended, without re-serializing it."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return body  # not an object (e.g. a /generate batch list): leave the engine's answer as it is
    separator = b"," if end[:-1].rstrip() not in (b"{", b"") else b""
    return end[:-1] + separator + b'"' + name + b'":' + value + b"}"


async def _write_error(
    request: web.Request, response: web.StreamResponse | None, error: GatewayError, streams: bool
) -> web.StreamResponse:
    if response is None:
        return web.Response(status=error.status, body=error.body(), headers=error.headers())
    await response.write_eof(error_after_keepalive(error.body(), streams=streams, status=error.status))
    return response
