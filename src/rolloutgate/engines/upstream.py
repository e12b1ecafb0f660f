"""A lean HTTP/1.1 client for generation calls: one POST per call, the answer read as it arrives, keep-alive.

Theory of operation: a generation is the gateway's hottest upstream call (one per request, held open for the
whole answer). aiohttp's client spends ~100 us of CPU and ~10 KB of objects on each one (request and header
objects, payload wrapper, timers, cookie jar, tracing hooks: measured in docs/benchmarks.md), and a
generation needs none of it: JSON bytes out to a known engine, a plain or chunked answer back. So generation
POSTs go through this module, everything else (probes, health, load, abort, control) stays on aiohttp.

- `UpstreamPool` (one per engine) keeps idle keep-alive connections; `pool.post(path, body, headers)` is an
  async context manager yielding an `UpstreamAnswer` once the status line and headers are in (with
  `push_to=sink`, a 200 event stream's body goes to the sink first, and the answer comes at its end).
  Leaving it after the body was read to its end returns the connection to the pool; leaving it any other way
  (an error, cancellation, a body not read to its end) closes the connection, which is how an engine learns
  that its client went away (vLLM aborts the generation then). An idle connection is reused only while it is
  younger than `_MAX_IDLE_S`, below the engines' own keep-alive limit.
- The connection itself (protocol, parser, pull or push delivery of the body) is engines/upstream_wire.py.
- `UpstreamAnswer` is what a generation reads of the answer: `status`, `content_type` (the media type), the
  body read (`read`, `readany`, `drain`) or pushed to a callback as it arrives (`start_push`,
  engines/generation.py), and `close()`.

Errors: those of upstream_wire.py, and TimeoutError (the connect phase took longer than `connect_timeout`).
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections.abc import Mapping
from types import TracebackType
from urllib.parse import urlsplit

from rolloutgate.engines.upstream_wire import (
    BodySink,
    UpstreamConnectError,
    UpstreamConnection,
    UpstreamDisconnected,
    UpstreamProtocolError,
)

__all__ = (
    "UpstreamAnswer",
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamPool",
    "UpstreamProtocolError",
    "close_all_pools",
)

_MAX_IDLE = 256  # idle connections kept per engine
# An idle connection older than this is closed instead of reused: servers close idle keep-alive connections
# (uvicorn, which serves vLLM and SGLang, after 5 s), and a request written as the server closes is lost
# ("Server disconnected", an attempt wasted on a healthy engine). Below the server's limit, that race is gone.
_MAX_IDLE_S = 4.0

_pools: weakref.WeakSet[UpstreamPool] = weakref.WeakSet()


class UpstreamAnswer:
    """The engine's answer to one `UpstreamPool.post`: its status and media type, and its body as it arrives.
    `pushed`: the whole body already went to the post's `push_to` sink (a 200 event stream); call
    `stop_push()` then."""

    __slots__ = ("_connection", "content_type", "pushed", "status")

    def __init__(self, connection: UpstreamConnection, *, pushed: bool = False) -> None:
        self._connection = connection
        self.status = connection.status
        self.content_type = connection.content_type  # lowercased, without parameters; "" without one
        self.pushed = pushed

    async def readany(self) -> bytes:
        """The body bytes that came since the last call (waiting for some); b"" at the end of the body."""
        return await self._connection.readany()

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

    async def drain(self, timeout_s: float) -> None:
        """Read the rest of the body (after `[DONE]`: normally only the chunked terminator) so that the
        connection can be reused; when that fails or takes longer than `timeout_s`, it is closed instead."""
        if self._connection.is_body_done:
            return  # the usual case: the terminator came with `[DONE]`
        try:
            async with asyncio.timeout(timeout_s):
                while await self._connection.readany():
                    pass
        except (OSError, UpstreamProtocolError):  # TimeoutError and UpstreamDisconnected are OSErrors
            self.close()

    def start_push(self, sink: BodySink) -> asyncio.Future[None]:
        """Hand the rest of the body to `sink` as it arrives, synchronously, from the reads of the socket.
        The future is done when the body ended or `sink` returned False (stop); its exception is what `sink`
        raised or the connection's failure (upstream_wire.py). Call `stop_push()` after it, whatever the
        outcome."""
        return self._connection.start_push(sink)

    def stop_push(self) -> None:
        self._connection.stop_push()

    def close(self) -> None:
        self._connection.close()


class _Post:
    """`async with pool.post(...) as response`: see UpstreamPool.post."""

    __slots__ = ("_connect_timeout", "_connection", "_pool", "_push_to", "_request")

    def __init__(
        self, pool: UpstreamPool, request: bytes, connect_timeout: float | None, push_to: BodySink | None
    ) -> None:
        self._pool = pool
        self._request = request
        self._connect_timeout = connect_timeout
        self._push_to = push_to
        self._connection: UpstreamConnection | None = None

    async def __aenter__(self) -> UpstreamAnswer:
        connection = await self._pool._acquire(self._connect_timeout)
        self._connection = connection
        try:  # the request bytes are not kept for the answer's lifetime (a 100K-token prompt is ~0.7 MB)
            pushed = await connection.send(self._take_request(), push_to=self._push_to)
        except BaseException:
            connection.stop_push()
            connection.close()
            raise
        return UpstreamAnswer(connection, pushed=pushed)

    def _take_request(self) -> bytes:
        request, self._request = self._request, b""
        return request

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        connection = self._connection
        if connection is None:
            return
        self._connection = None
        self._pool.finish(connection, ok=kind is None)


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
        self._idle: list[UpstreamConnection] = []
        _pools.add(self)

    def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        connect_timeout: float | None = None,
        push_to: BodySink | None = None,
    ) -> _Post:
        """POST `body` (JSON) to `path`; an async context manager yielding the `UpstreamAnswer` once the
        headers are in, or with `push_to`, once a 200 event stream was pushed to it to its end (the response's
        `pushed`; its errors raise here; upstream_wire.py).

        Raises ValueError for a header name or value with a line break (nothing is sent).
        """
        return _Post(self, self.request_bytes(path, body, headers), connect_timeout, push_to)

    def request_bytes(self, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        """The POST of `body` (JSON) to `path` as written on the wire. Raises ValueError for a header name or
        value with a line break."""
        lines = [b"POST ", path.encode("utf-8"), b" HTTP/1.1\r\nHost: ", self._host_header, b"\r\n"]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        lines += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        return b"".join(lines)

    def take_idle(self) -> UpstreamConnection | None:
        """An idle keep-alive connection fresh enough to reuse, now; None if there is none. The caller owns
        it and gives it back with `finish`."""
        idle = self._idle
        if idle:
            fresh_after = asyncio.get_running_loop().time() - _MAX_IDLE_S
            while idle:
                connection = idle.pop()  # the most recently used first
                if connection.is_idle_usable and connection.idle_since >= fresh_after:
                    return connection
                connection.close()
        return None

    def finish(self, connection: UpstreamConnection, *, ok: bool) -> None:
        """A call on `connection` ended: back to the pool when it ended well with its answer read to its end
        on a reusable connection, else closed (how an engine learns that its client went away)."""
        if ok and connection.is_body_done and connection.is_reusable and not connection.is_closed:
            connection.finish_use()
            self._release(connection)
        else:
            connection.close()

    async def _acquire(self, connect_timeout: float | None) -> UpstreamConnection:
        idle = self.take_idle()
        if idle is not None:
            return idle
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, protocol = await loop.create_connection(
                    UpstreamConnection,
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

    def _release(self, connection: UpstreamConnection) -> None:
        if len(self._idle) < _MAX_IDLE:
            connection.idle_since = asyncio.get_running_loop().time()
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
