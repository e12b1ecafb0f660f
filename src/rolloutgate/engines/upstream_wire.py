"""The wire side of the lean generation client (engines/upstream.py): one keep-alive HTTP/1.1 connection.

Theory of operation: `UpstreamConnection` is an asyncio Protocol with a sans-IO parser in `data_received`:
status line and headers, then the body as `Content-Length` bytes, `chunked` pieces, or bytes up to the close.
The body goes one of two ways:

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
  `text/event-stream`, the push starts in the read that brought the head, and `send` returns only when the
  push settles (True). The caller's task then wakes once per answer instead of twice (headers, then body),
  ~3% of the gateway's CPU per request at 32 connections (docs/benchmarks.md). Any other head is returned
  as without it (False), for the caller to read as it would.

Errors (mapped to UpstreamError by `engines.http.map_exceptions`, with the same messages as aiohttp's):
`UpstreamConnectError` (no connection could be made: the engine is unreachable), `UpstreamDisconnected` (the
connection closed before the answer ended), `UpstreamProtocolError` (not an HTTP answer we can read).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import NamedTuple

__all__ = (
    "BodySink",
    "ParsedHead",
    "UpstreamConnectError",
    "UpstreamConnection",
    "UpstreamDisconnected",
    "UpstreamProtocolError",
    "parse_head",
)

_HIGH_WATER = 256 * 1024  # queued body bytes above which the socket is not read
_MAX_HEAD = 64 * 1024  # status line + headers

# the answer's headers this client reads (the others are not kept: they would cost memory per open stream)
_KEPT_HEADERS = {
    name.encode(): name
    for name in ("content-type", "content-length", "transfer-encoding", "connection", "content-encoding")
}

# parser states
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_EOF, _DONE = range(9)

BodySink = Callable[[bytes], bool]  # a body piece -> keep going (False: stop)


class UpstreamConnectError(OSError):
    """No connection could be made (refused, unreachable, DNS)."""


class UpstreamDisconnected(ConnectionError):
    """The connection closed before the answer ended."""


class UpstreamProtocolError(Exception):
    """The engine's answer is not HTTP/1.x this client can read."""


def _is_event_stream(content_type: str) -> bool:
    return content_type.partition(";")[0].strip().lower() == "text/event-stream"


class ParsedHead(NamedTuple):
    """What this client reads of an answer's status line and headers."""

    status: int
    content_type: str  # as sent ("" without one)
    is_event_stream: bool  # the content type is text/event-stream
    keeps_alive: bool  # HTTP/1.1 and no `Connection: close`
    framing: int  # how the body ends: _CHUNK_SIZE (chunked), _LENGTH, _DONE (no body) or _UNTIL_EOF
    length: int  # the Content-Length with _LENGTH


@functools.lru_cache(maxsize=64)
def parse_head(head: bytes) -> ParsedHead | None:
    """The status line and headers (`head`, without the blank line); None for an interim (1xx) answer.
    Raises ValueError for a head this client cannot read.

    Cached: an engine answers with the same head bytes but for its Date line (once a second) and, for
    whole bodies, Content-Length; ~20 string operations per answer otherwise (docs/benchmarks.md)."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(rest[:3])
    if 100 <= status < 200:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        name_text = _KEPT_HEADERS.get(name.strip().lower())
        if name_text is None or not sep:
            continue
        text = value.strip().decode("latin-1")
        headers[name_text] = f"{headers[name_text]}, {text}" if name_text in headers else text
    encoding = headers.get("content-encoding", "identity").lower()
    if encoding not in ("identity", ""):
        raise ValueError(f"a {encoding}-encoded answer (no encoding was asked for)")
    keeps_alive = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    content_type = headers.get("content-type", "")
    stream = _is_event_stream(content_type)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return ParsedHead(status, content_type, stream, keeps_alive, _CHUNK_SIZE, 0)
    if "content-length" in headers:
        length = int(headers["content-length"])
        if length < 0:
            raise ValueError("negative Content-Length")
        return ParsedHead(status, content_type, stream, keeps_alive, _LENGTH, length)
    if status in (204, 304):
        return ParsedHead(status, content_type, stream, keeps_alive, _DONE, 0)
    return ParsedHead(
        status, content_type, stream, False, _UNTIL_EOF, 0
    )  # delimited by the close: not reusable


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it."""

    __slots__ = (
        "_armed",
        "_buffered",
        "_drain_waiter",
        "_error",
        "_head_waiter",
        "_is_paused",
        "_pieces",
        "_push_done",
        "_raw",
        "_remaining",
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
        self._raw = bytearray()
        self._state = _IDLE
        self._remaining = 0
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
        self._push_done: asyncio.Future[None] | None = None
        self.status = 0
        self.content_type = ""  # the answer's Content-Type header, as sent ("" without one)
        self.is_closed = False
        self.is_reusable = True
        self.idle_since = 0.0  # loop time when it went back to its pool

    # -- asyncio.Protocol ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        self.is_reusable = False
        state = self._state
        if state == _UNTIL_EOF:
            self._state = _DONE  # a body delimited by the close has ended
        elif state not in (_IDLE, _DONE) and self._error is None:
            detail = f": {exc}" if exc else ""
            if state == _HEAD:
                message = f"Server disconnected{detail}"
            else:
                message = f"Response payload is not completed{detail}"
            self._error = UpstreamDisconnected(message)
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
        if self._state in (_IDLE, _DONE):
            self.is_reusable = False  # bytes nobody asked for: this connection cannot be trusted again
            return
        raw = self._raw
        buffer: bytes | bytearray = data  # parsed in place when nothing is left over from the last read
        if raw:
            raw += data
            buffer = raw
        try:
            consumed = self._parse(buffer)
        except (ValueError, UnicodeDecodeError, IndexError) as exc:
            self._fail(UpstreamProtocolError(f"unreadable HTTP answer: {exc}"))
            return
        if self._sink is not None and self._pieces:
            self._push_read()
        if buffer is raw:
            del raw[:consumed]
        elif consumed < len(data):
            raw += data[consumed:]
        if self._state == _DONE and raw:
            self.is_reusable = False

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost ends what was being read

    # -- parsing ---------------------------------------------------------------------------------------------

    def _parse(self, raw: bytes | bytearray) -> int:
        """Consume what `raw` holds; returns how many bytes were used."""
        pos = 0
        size = len(raw)
        while pos < size:
            state = self._state
            if state == _HEAD:
                end = raw.find(b"\r\n\r\n", pos)
                if end < 0:
                    if size - pos > _MAX_HEAD:
                        raise ValueError("the status line and headers are too long")
                    break
                self._read_head(bytes(raw[pos:end]))
                pos = end + 4
            elif state in (_CHUNK_DATA, _LENGTH):
                take = min(size - pos, self._remaining)
                self._emit(bytes(raw[pos : pos + take]))
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    if state == _LENGTH:
                        self._finish_body()
                    else:
                        self._state = _CHUNK_END
            elif state == _CHUNK_SIZE:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > 1024:
                        raise ValueError("chunk size line too long")
                    break
                line = raw[pos:end]
                extension = line.find(b";")
                chunk_size = int(line if extension < 0 else line[:extension], 16)  # int() strips blanks
                pos = end + 2
                if chunk_size < 0:
                    raise ValueError("negative chunk size")
                if chunk_size == 0:
                    self._state = _TRAILERS
                elif raw[pos + chunk_size : pos + chunk_size + 2] == b"\r\n":
                    # The whole chunk and its CRLF are in this read (the usual case): one step, not three.
                    self._emit(bytes(raw[pos : pos + chunk_size]))
                    pos += chunk_size + 2
                else:
                    self._remaining = chunk_size
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_END:
                if size - pos < 2:
                    break
                if raw[pos : pos + 2] != b"\r\n":
                    raise ValueError("a chunk does not end with CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = raw.find(b"\r\n", pos)
                if end < 0:
                    break
                is_last = end == pos
                pos = end + 2
                if is_last:
                    self._finish_body()
            elif state == _UNTIL_EOF:
                self._emit(bytes(raw[pos:size]))
                pos = size
            else:  # _DONE, _IDLE: leftovers are dropped by the caller
                break
        return pos

    def _read_head(self, head: bytes) -> None:
        parsed = parse_head(head)
        if parsed is None:
            return  # an interim answer (100 Continue): the real one follows
        self.status = parsed.status
        # only the content type is kept (a dict per open stream is memory held for nothing)
        self.content_type = parsed.content_type
        if not parsed.keeps_alive:
            self.is_reusable = False
        self._state = parsed.framing
        if parsed.framing == _LENGTH:
            self._remaining = parsed.length
            if parsed.length == 0:
                self._finish_body()
        elif parsed.framing == _DONE:
            self._finish_body()  # 204, 304: no body
        armed = self._armed
        if armed is not None:
            self._armed = None
            pushable = parsed.status == 200 and self._state != _DONE and parsed.is_event_stream
            if pushable and self._head_waiter is not None:
                # The push starts here, with the body of this read; the waiter of `send` becomes the push's.
                # (Not while `send` waits for its request to drain: it reads the head as without a sink then.)
                self._sink = armed
                self._push_done, self._head_waiter = self._head_waiter, None
                return
        self._wake_head()

    def _emit(self, piece: bytes) -> None:
        if not piece:
            return
        if self._sink is not None:
            self._pieces.append(piece)  # pushed together once the read is parsed (`_push_read`)
            return
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > _HIGH_WATER and not self._is_paused and self.transport is not None:
            self._is_paused = True
            self.transport.pause_reading()
        self._wake()

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
                await waiter  # the push's outcome when the head started one (`_read_head`)
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
        self._push_done = done
        self._sink = sink
        pieces = self._pieces
        if pieces:
            queued = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            self._buffered = 0
            self._deliver(queued)
        if self._is_paused and self.transport is not None and not self.is_closed:
            self._is_paused = False  # a sink takes everything: nothing queues any more
            self.transport.resume_reading()
        if self._sink is not None:
            if self._error is not None:
                self._settle_push(self._error)
            elif self._state == _DONE:
                self._settle_push(None)
        return done

    def stop_push(self) -> None:
        """Detach the sink; later body pieces queue for `readany()` again."""
        self._sink = None
        self._push_done = None

    def _push_read(self) -> None:
        """Hand the body pieces parsed from one read to the sink, in one piece."""
        pieces = self._pieces
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
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
