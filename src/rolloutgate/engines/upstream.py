"""A lean HTTP/1.1 client for generation calls: one POST per call, the answer read as it arrives, keep-alive.

Theory of operation: a generation is the gateway's hottest upstream call (one per request, held open for the
whole answer). aiohttp's client spends ~100 us of CPU and ~10 KB of objects on each one (request and header
objects, payload wrapper, timers, cookie jar, tracing hooks: measured in docs/benchmarks.md), and a
generation needs none of it: JSON bytes out to a known engine, a plain or chunked answer back. So generation
POSTs go through this module, everything else (probes, health, load, abort, control) stays on aiohttp.

- `UpstreamPool` (one per engine) keeps idle keep-alive connections; `pool.post(path, body, headers)` is an
  async context manager yielding an `UpstreamResponse` once the status line and headers are in. Leaving it
  after the body was read to its end returns the connection to the pool; leaving it any other way
  (an error, cancellation, a body not read to its end) closes the connection, which is how an engine learns
  that its client went away.
- `_Connection` is an asyncio Protocol with a sans-IO parser in `data_received`: status line and headers, then
  the body as `Content-Length` bytes, `chunked` pieces, or bytes up to the close. Body pieces are queued as
  they arrive (a chunk split across reads is handed out in parts: the SSE parser takes any split), reading is
  paused above `_HIGH_WATER` queued bytes and resumed below `_LOW_WATER`.
- `UpstreamResponse` duck-types the part of `aiohttp.ClientResponse` that engines/http.py uses (`status`,
  `content_type`, `read()`, `close()`, and `content.iter_any()`, `readany()`, `read(n)`, `at_eof()`), so the
  SSE reader, the status check and the drain after `[DONE]` serve both clients unchanged.

Errors (mapped to UpstreamError by `engines.http.map_exceptions`, with the same messages as aiohttp's):
`UpstreamConnectError` (no connection could be made: the engine is unreachable), `UpstreamDisconnected` (the
connection closed before the answer ended), `UpstreamProtocolError` (not an HTTP answer we can read),
TimeoutError (the connect phase took longer than `connect_timeout`).
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections.abc import Mapping
from types import TracebackType
from urllib.parse import urlsplit

__all__ = (
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "close_all_pools",
)

_HIGH_WATER = 256 * 1024  # queued body bytes above which the socket is not read
_LOW_WATER = 64 * 1024
_MAX_HEAD = 64 * 1024  # status line + headers
_MAX_IDLE = 256  # idle connections kept per engine

# the answer's headers this client reads (the others are not kept: they would cost memory per open stream)
_KEPT_HEADERS = {
    name.encode(): name
    for name in ("content-type", "content-length", "transfer-encoding", "connection", "content-encoding")
}

# parser states
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _UNTIL_EOF, _DONE = range(9)

_pools: weakref.WeakSet[UpstreamPool] = weakref.WeakSet()


class UpstreamConnectError(OSError):
    """No connection could be made (refused, unreachable, DNS)."""


class UpstreamDisconnected(ConnectionError):
    """The connection closed before the answer ended."""


class UpstreamProtocolError(Exception):
    """The engine's answer is not HTTP/1.x this client can read."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the answer being read on it."""

    __slots__ = (
        "_buffered",
        "_drain_waiter",
        "_error",
        "_head_waiter",
        "_is_paused",
        "_pieces",
        "_raw",
        "_remaining",
        "_state",
        "_waiter",
        "_write_paused",
        "headers",
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
        self._pieces: list[bytes] = []  # body bytes not read yet (a reader takes them all at once)
        self._buffered = 0
        self._is_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.is_closed = False
        self.is_reusable = True

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
                chunk_size = int(bytes(raw[pos:end]).split(b";", 1)[0].strip(), 16)
                pos = end + 2
                if chunk_size < 0:
                    raise ValueError("negative chunk size")
                if chunk_size == 0:
                    self._state = _TRAILERS
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
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(rest[:3])
        if 100 <= status < 200:
            return  # an interim answer (100 Continue): the real one follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            key = name.strip().lower()
            if not sep or key not in _KEPT_HEADERS:
                continue
            name_text = _KEPT_HEADERS[key]
            text = value.strip().decode("latin-1")
            headers[name_text] = f"{headers[name_text]}, {text}" if name_text in headers else text
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise ValueError(f"a {encoding}-encoded answer (no encoding was asked for)")
        self.status = status
        self.headers = headers
        connection = headers.get("connection", "").lower()
        if version != b"HTTP/1.1" or "close" in connection:
            self.is_reusable = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            length = int(headers["content-length"])
            if length < 0:
                raise ValueError("negative Content-Length")
            self._remaining = length
            self._state = _LENGTH
            if length == 0:
                self._finish_body()
        elif status in (204, 304):
            self._finish_body()
        else:
            self._state = _UNTIL_EOF
            self.is_reusable = False
        self._wake_head()

    def _emit(self, piece: bytes) -> None:
        if not piece:
            return
        self._pieces.append(piece)
        self._buffered += len(piece)
        if self._buffered > _HIGH_WATER and not self._is_paused and self.transport is not None:
            self._is_paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish_body(self) -> None:
        self._state = _DONE
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.is_reusable = False
        self._wake()
        self._wake_head()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_head(self) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
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

    async def send(self, request: bytes) -> None:
        """Write one request and wait for its status line and headers."""
        assert self.transport is not None
        self._state = _HEAD
        self._pieces.clear()
        self._buffered = 0
        self._error = None
        self.transport.write(request)
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
            self._head_waiter = loop.create_future()
            try:
                await self._head_waiter
            finally:
                self._head_waiter = None
        if self._error is not None and self.status == 0:
            raise self._error

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

    def finish_use(self) -> None:
        """The caller read the whole answer: ready for the next request."""
        self._state = _IDLE
        self.status = 0
        self.headers = {}

    def close(self) -> None:
        self.is_reusable = False
        if self.transport is not None and not self.is_closed:
            self.transport.close()


class _BodyIterator:
    __slots__ = ("_connection",)

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection

    def __aiter__(self) -> _BodyIterator:
        return self

    async def __anext__(self) -> bytes:
        piece = await self._connection.readany()
        if not piece:
            raise StopAsyncIteration
        return piece


class UpstreamResponse:
    """The answer of one `UpstreamPool.post`: status, headers, and the body as it arrives."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = connection.status
        self.headers = connection.headers  # lower-case names; only the framing ones and content-type

    @property
    def content(self) -> UpstreamResponse:
        return self  # aiohttp's `resp.content` stream: the same object here

    @property
    def content_type(self) -> str:
        value = self.headers.get("content-type")
        if not value:
            return "application/octet-stream"  # what aiohttp reports for an answer without one
        return value.split(";", 1)[0].strip().lower()

    def iter_any(self) -> _BodyIterator:
        return _BodyIterator(self._connection)

    async def readany(self) -> bytes:
        return await self._connection.readany()

    def at_eof(self) -> bool:
        return self._connection.is_body_done

    async def read(self, limit: int = -1) -> bytes:
        """The rest of the body, or at most `limit` bytes of it."""
        parts: list[bytes] = []
        size = 0
        while limit < 0 or size < limit:
            piece = await self._connection.readany()
            if not piece:
                break
            parts.append(piece)
            size += len(piece)
        data = b"".join(parts)
        return data if limit < 0 else data[:limit]

    def close(self) -> None:
        self._connection.close()


class _Post:
    """`async with pool.post(...) as response`: see UpstreamPool.post."""

    __slots__ = ("_connect_timeout", "_connection", "_pool", "_request")

    def __init__(self, pool: UpstreamPool, request: bytes, connect_timeout: float | None) -> None:
        self._pool = pool
        self._request = request
        self._connect_timeout = connect_timeout
        self._connection: _Connection | None = None

    async def __aenter__(self) -> UpstreamResponse:
        connection = await self._pool._acquire(self._connect_timeout)
        self._connection = connection
        request, self._request = self._request, b""  # not kept for the answer's lifetime (prompts are big)
        try:
            await connection.send(request)
        except BaseException:
            connection.close()
            raise
        return UpstreamResponse(connection)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        connection = self._connection
        if connection is None:
            return
        self._connection = None
        if kind is None and connection.is_body_done and connection.is_reusable and not connection.is_closed:
            connection.finish_use()
            self._pool._release(connection)
        else:
            connection.close()


class UpstreamPool:
    """Keep-alive connections to one engine (`http://host:port` or `https://...`)."""

    __slots__ = ("__weakref__", "_host", "_host_header", "_idle", "_port", "_ssl", "base_url")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = parts.hostname
        secure = parts.scheme == "https"
        default_port = 443 if secure else 80
        self._port = parts.port or default_port
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if secure else None
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._host_header = (host if self._port == default_port else f"{host}:{self._port}").encode("idna")
        self._idle: list[_Connection] = []
        _pools.add(self)

    def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_timeout: float | None = None,
    ) -> _Post:
        """POST `body` (JSON) to `path`; an async context manager yielding the `UpstreamResponse`.

        Raises ValueError for a header name or value with a line break (nothing is sent).
        """
        lines = [b"POST ", path.encode("utf-8"), b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\n"]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        lines += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        return _Post(self, b"".join(lines), connect_timeout)

    async def _acquire(self, connect_timeout: float | None) -> _Connection:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if connection.is_idle_usable:
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, protocol = await loop.create_connection(
                    _Connection,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise
        except OSError as exc:
            raise UpstreamConnectError(
                f"Cannot connect to host {self._host}:{self._port} [{exc.strerror or exc}]"
            ) from exc
        return protocol

    def _release(self, connection: _Connection) -> None:
        if len(self._idle) < _MAX_IDLE:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        """Close the idle connections (answers being read keep theirs until they end)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @property
    def idle_count(self) -> int:
        return len(self._idle)


def close_all_pools() -> None:
    """Close every pool's idle connections (at shutdown, after the last generation)."""
    for pool in list(_pools):
        pool.close()
