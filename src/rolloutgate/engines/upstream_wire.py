"""The wire side of the lean generation client (engines/upstream.py): one keep-alive HTTP/1.1 connection.

Theory of operation: `UpstreamConnection` is an asyncio Protocol whose reads go to httptools' response
parser (llhttp: C, strict RFC 9112 framing of the status line, headers, Content-Length, chunked bodies, the
end of the answer and the keep-alive verdict); this module reacts to its callbacks and parses nothing.
`on_headers_complete` takes the status, the media type and whether the connection may be reused
(`should_keep_alive`: not after HTTP/1.0, `Connection: close` or a body delimited by the close), `on_body`
the body pieces, `on_message_complete` the end. Checked here, as llhttp leaves them to its user: a transfer
coding other than `chunked` (llhttp would read `chunked, gzip` to the close) or a content coding (none was
asked for), a status below 100, an upgrade, a head over `_MAX_HEAD`, bytes after the answer (the connection
is not reused then), and the end of a body with neither Content-Length nor Transfer-Encoding, which is the
close (llhttp has no end-of-input call). The body goes one of two ways:

- pulled (the default): pieces are queued as they arrive (a chunk split across reads is handed out in parts:
  the SSE parser takes any split) and `readany()` takes them all; reading is paused above `_HIGH_WATER`
  queued bytes and resumed below it once read;
- pushed (`start_push(sink)`): the body bytes of each read are handed to `sink` synchronously, in one piece,
  at the end of the read that brought them (several chunks of one read together: a streaming answer's
  tokens arrive several to a read and the driver then handles them at once), so a consumer that handles
  events at once (the driver) costs no task switch per piece. The returned future is
  done when the body ends, when the connection fails (its exception), when `sink` raises (that exception),
  or when `sink` returns False (stop: the caller closes the connection). `stop_push()` detaches the sink.
  `send(request, push_to=sink)` arms the push before the answer comes: when its head says 200 and
  `text/event-stream`, the push starts at the end of the read that brought the head, with that read's body,
  and `send` returns only when the push settles (True). The caller's task then wakes once per answer instead
  of twice (headers, then body), ~3% of the gateway's CPU per request at 32 connections (docs/benchmarks.md).
  Any other head, and a stream that ended in that read without a byte of body, is returned as without it
  (False), for the caller to read as it would.

Errors (mapped to UpstreamError by `engines.http.map_exceptions`, with the same messages as aiohttp's):
`UpstreamConnectError` (no connection could be made: the engine is unreachable), `UpstreamDisconnected` (the
connection closed before the answer ended), `UpstreamProtocolError` (not an HTTP answer we can read: every
`httptools.HttpParserError`, as "unreadable HTTP answer: <llhttp's reason>").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import httptools

__all__ = (
    "BodySink",
    "UpstreamConnectError",
    "UpstreamConnection",
    "UpstreamDisconnected",
    "UpstreamProtocolError",
)

_HIGH_WATER = 256 * 1024  # queued body bytes above which the socket is not read
_MAX_HEAD = 64 * 1024  # the reads that brought the status line and headers (llhttp has no limit)

# the headers this client reads (the others are not kept: they would cost memory per open stream)
_TYPE, _LENGTH, _TRANSFER, _CODING = range(4)
_WATCHED = {
    b"content-type": _TYPE,
    b"content-length": _LENGTH,
    b"transfer-encoding": _TRANSFER,
    b"content-encoding": _CODING,
}

# states of the answer being read
_IDLE, _HEAD, _BODY, _DONE = range(4)

BodySink = Callable[[bytes], bool]  # a body piece -> keep going (False: stop)


# what a reason phrase may hold (RFC 9112 section 4: HTAB, SP, VCHAR, obs-text)
_REASON_BYTES = bytes([0x09, *range(0x20, 0x7F), *range(0x80, 0x100)])


class UpstreamConnectError(OSError):
    """No connection could be made (refused, unreachable, DNS)."""


class UpstreamDisconnected(ConnectionError):
    """The connection closed before the answer ended."""


class UpstreamProtocolError(Exception):
    """The engine's answer is not HTTP/1.x this client can read."""


def _unreadable(reason: str) -> UpstreamProtocolError:
    return UpstreamProtocolError(f"unreadable HTTP answer: {reason}")


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it."""

    __slots__ = (
        "_armed",
        "_arming",
        "_buffered",
        "_drain_waiter",
        "_error",
        "_framed",
        "_head_size",
        "_head_waiter",
        "_is_paused",
        "_parser",
        "_pieces",
        "_push_done",
        "_sink",
        "_state",
        "_waiter",
        "_write_paused",
        "content_type",
        "idle_since",
        "is_closed",
        "is_reusable",
        "status",
        "transport",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        # one parser for the connection's life: llhttp starts the next answer where a kept-alive one ended
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._framed = False  # the answer has Content-Length or Transfer-Encoding (else the close ends it)
        self._head_size = 0
        # body bytes not read yet (a reader takes them all at once); pushing, those of this read not yet pushed
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._is_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._sink: BodySink | None = None  # push mode: body pieces go here as they arrive
        self._armed: BodySink | None = None  # the sink to push to if the head allows (`send(push_to=...)`)
        self._arming: BodySink | None = None  # the head allowed it: the push starts at the end of this read
        self._push_done: asyncio.Future[None] | None = None
        self.status = 0
        self.content_type = ""  # the answer's media type, lowercased ("" without a Content-Type)
        self.is_closed = False
        self.is_reusable = True
        self.idle_since = 0.0  # loop time when it went back to its pool

    # -- asyncio.Protocol ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.is_reusable = False
        self._parser = None  # it holds this protocol's bound methods: no cycle outlives the connection
        state = self._state
        if state in (_HEAD, _BODY) and self._error is None:
            if state == _BODY and not self._framed:
                self._finish_body()  # a body delimited by the close has ended
            else:
                what = "Server disconnected" if state == _HEAD else "Response payload is not completed"
                self._error = UpstreamDisconnected(f"{what}: {exc}" if exc else what)
        self._wake()
        self._wake_head()
        self._settle_push(self._error)
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if self._state in (_IDLE, _DONE) or parser is None:
            self.is_reusable = False  # bytes nobody asked for: this connection cannot be trusted again
            return
        error: UpstreamProtocolError | None = None
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, UpstreamProtocolError):
                raise  # a bug in a callback, not the engine's answer
            error = exc.__context__  # a callback refused the answer
        except httptools.HttpParserUpgrade:
            error = _unreadable("an upgrade nobody asked for")
        except httptools.HttpParserError as exc:
            error = _unreadable(str(exc))
        if self._state == _HEAD:
            self._head_size += len(data)
            if self._head_size > _MAX_HEAD and error is None:
                error = _unreadable("the status line and headers are too long")
        arming = self._arming
        if arming is not None:
            self._arming = None
            self._start_armed(arming)
        elif self._sink is not None and self._pieces:
            self._push_read()
        if error is not None:
            if self._state == _DONE:
                self.is_reusable = False  # what came after the answer is not this client's to read
            else:
                self._fail(error)

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost ends what was being read

    # -- httptools' callbacks (inside `feed_data`; UpstreamProtocolError refuses the answer) ----------------

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            raise _unreadable("bytes after the answer")
        self._framed = False
        self.content_type = ""

    def on_status(self, reason: bytes) -> None:
        # llhttp lets control bytes through in the reason phrase; RFC 9112 allows HTAB, SP, VCHAR, obs-text
        if reason.translate(None, _REASON_BYTES):
            raise _unreadable("a control byte in the status line's reason phrase")

    def on_header(self, name: bytes, value: bytes) -> None:
        kind = _WATCHED.get(name.lower())
        if kind is None or self.status:  # not read, or a trailer (the head was complete)
            return
        if kind == _TYPE:
            self.content_type = value.partition(b";")[0].strip().lower().decode("latin-1")
            return
        if kind != _CODING:
            self._framed = True  # the length, or the chunks: llhttp checks them
            if kind == _LENGTH:
                return
        coding = value.strip().lower()
        if kind == _TRANSFER and coding != b"chunked":
            raise _unreadable(f"Transfer-Encoding {coding.decode('latin-1')!r} (only chunked is read)")
        if kind == _CODING and coding not in (b"identity", b""):
            raise _unreadable(f"a {coding.decode('latin-1')}-encoded answer (no encoding was asked for)")

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None  # called from its `feed_data`
        status = parser.get_status_code()
        if status < 200:
            if status < 100:
                raise _unreadable(f"status {status}")
            return  # an interim answer (100 Continue): the real one follows
        self.status = status
        self._state = _BODY
        if not parser.should_keep_alive():
            self.is_reusable = False
        armed, self._armed = self._armed, None
        if (
            armed is not None
            and status == 200
            and self.content_type == "text/event-stream"
            and self._head_waiter is not None
        ):  # (not while `send` waits for its request to drain: it reads the head as without a sink then)
            self._arming = armed
            return
        self._wake_head()

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)  # pushed, the pieces of a read go over together at its end
        if self._sink is None:
            self._buffered += len(body)
            if self._buffered > _HIGH_WATER and not self._is_paused and self.transport is not None:
                self._is_paused = True
                self.transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        if self.status:  # not the end of an interim answer
            self._finish_body()

    # -- the answer's end -----------------------------------------------------------------------------------

    def _finish_body(self) -> None:
        self._state = _DONE
        if self._sink is not None and self._pieces:
            self._push_read()
        self._wake()
        self._settle_push(None)

    def _fail(self, error: BaseException) -> None:
        if self._sink is not None and self._pieces:
            self._push_read()  # what the read brought before the fault, as if handed over piece by piece
        self._error = error
        self.is_reusable = False
        self._wake()
        self._wake_head()
        self._settle_push(error)
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_head(self) -> None:
        waiter = self._head_waiter
        if waiter is not None:
            self._head_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _start_armed(self, sink: BodySink) -> None:
        """The end of the read that brought a 200 event stream's head: the push starts with this read's body,
        and the waiter of `send` becomes the push's; unless the stream already ended without a body."""
        if self._pieces or self._state != _DONE:
            waiter, self._head_waiter = self._head_waiter, None
            assert waiter is not None  # checked with the head, in this read
            self._begin_push(sink, waiter)
        else:
            self._wake_head()

    # -- the caller's side -----------------------------------------------------------------------------------

    @property
    def is_idle_usable(self) -> bool:
        transport = self.transport
        return (
            not self.is_closed
            and self.is_reusable
            and self._state == _IDLE
            and transport is not None
            and not transport.is_closing()
        )

    async def send(self, request: bytes, *, push_to: BodySink | None = None) -> bool:
        """Write one request and wait for its status line and headers. With `push_to`, a 200 event stream is
        pushed to it from its first byte on and this returns True once the push settled (raising its error);
        otherwise False once the headers are in (module docstring). Call `stop_push()` after a push."""
        self._begin(request, push_to)
        del request  # not held while the answer streams: a 100K-token prompt is ~0.7 MB
        loop = asyncio.get_running_loop()
        if self._write_paused and not self.is_closed:
            self._drain_waiter = loop.create_future()
            await self._drain_waiter
            self._drain_waiter = None
        while self._state == _HEAD:
            if self._error is not None:
                raise self._error
            if self.is_closed:
                raise UpstreamDisconnected("Server disconnected")
            waiter = self._head_waiter = loop.create_future()
            try:
                await waiter  # the push's outcome when the head started one (`_start_armed`)
            finally:
                self._head_waiter = None
                self._armed = None
            if waiter is self._push_done:
                return True
        error = self.failure_before_status()
        if error is not None:
            raise error
        return False

    def start(self, request: bytes, *, push_to: BodySink) -> asyncio.Future[None]:
        """`send(request, push_to=...)` without a coroutine: returns the future that settles once the push
        settled (then `is_push(future)`; its exception is the push's) or once other headers came or the
        connection failed before them (then `failure_before_status()`, else read the answer as after `send`).
        Call `stop_push()` after a push. The request is buffered whole by the transport."""
        self._begin(request, push_to)
        waiter = self._head_waiter = asyncio.get_running_loop().create_future()
        return waiter

    def is_push(self, future: asyncio.Future[None]) -> bool:
        return future is self._push_done

    def _begin(self, request: bytes, push_to: BodySink | None) -> None:
        assert self.transport is not None
        self._state = _HEAD
        self._head_size = 0
        self._pieces.clear()
        self._buffered = 0
        self._error = None
        self.stop_push()  # nothing of an earlier answer's push is left
        self._armed = push_to
        self.transport.write(request)

    def failure_before_status(self) -> BaseException | None:
        """What ended the answer before its status line, if something did."""
        if self.status == 0:
            return self._error or (UpstreamDisconnected("Server disconnected") if self.is_closed else None)
        return None

    async def readany(self) -> bytes:
        """The body bytes queued now (waiting for some if none); b"" at the end of the body."""
        pieces = self._pieces
        while not pieces:
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        if self._is_paused and self.transport is not None and not self.is_closed:
            self._is_paused = False
            self.transport.resume_reading()
        return piece

    @property
    def is_body_done(self) -> bool:
        return self._state == _DONE and not self._pieces

    def start_push(self, sink: BodySink) -> asyncio.Future[None]:
        """Push mode (module docstring): the body pieces queued so far go to `sink` at once, later ones as
        they arrive. Returns the future that settles the push."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._begin_push(sink, done)
        return done

    def _begin_push(self, sink: BodySink, done: asyncio.Future[None]) -> None:
        self._push_done = done
        self._sink = sink
        if self._pieces:
            self._push_read()
        if self._is_paused and self.transport is not None and not self.is_closed:
            self._is_paused = False  # a sink takes everything: nothing queues any more
            self.transport.resume_reading()
        if self._sink is not None:
            if self._error is not None:
                self._settle_push(self._error)
            elif self._state == _DONE:
                self._settle_push(None)

    def stop_push(self) -> None:
        """Detach the sink; later body pieces queue for `readany()` again."""
        self._sink = None
        self._push_done = None

    def _push_read(self) -> None:
        """Hand the body pieces queued (those of one read, or all before a push) to the sink, in one piece."""
        pieces = self._pieces
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self._buffered = 0
        self._deliver(piece)

    def _deliver(self, piece: bytes) -> None:
        sink = self._sink
        assert sink is not None
        try:
            keep = sink(piece)
        except Exception as exc:  # the consumer's verdict on the body (e.g. an error event) ends the push
            self._sink = None
            self._settle_push(exc)
            return
        if not keep:
            self._sink = None
            self._settle_push(None)

    def _settle_push(self, error: BaseException | None) -> None:
        done = self._push_done
        if done is None or done.done():
            return
        self._sink = None
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def finish_use(self) -> None:
        """The caller read the whole answer: ready for the next request."""
        self._state = _IDLE
        self.status = 0
        self.content_type = ""

    def close(self) -> None:
        self.is_reusable = False
        if self.transport is not None and not self.is_closed:
            self.transport.close()
