"""The lean generation client (engines/upstream.py), added for the hot path: framing, reuse, failures.

A scripted loopback server answers each request with raw bytes, so every framing case is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.http import map_exceptions
from rolloutgate.engines.upstream import (
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamProtocolError,
)

Script = Callable[[bytes], list[bytes] | None]  # request head+body -> writes (None: close without answer)


class ScriptedServer:
    def __init__(self) -> None:
        self.script: Script = lambda _request: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        self.requests: list[bytes] = []
        self.connections = 0
        self.close_after_answer = False
        self.gap_s = 0.0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                writes = self.script(request)
                if writes is None:
                    break
                for piece in writes:
                    writer.write(piece)
                    await writer.drain()
                    if self.gap_s:
                        await asyncio.sleep(self.gap_s)
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    scripted = ScriptedServer()
    await scripted.start()
    yield scripted
    await scripted.close()


def _bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


async def _read_all(pool: UpstreamPool, path: str = "/generate") -> tuple[int, str, bytes]:
    async with pool.post(path, b'{"x":1}', {"Content-Type": "application/json"}) as response:
        body = b"".join([piece async for piece in response.content.iter_any()])
        return response.status, response.content_type, body


async def test_content_length_answer_and_the_connection_is_reused(server: ScriptedServer) -> None:
    pool = UpstreamPool(server.url)
    for _ in range(3):
        assert await _read_all(pool) == (200, "application/octet-stream", b"ok")
    assert server.connections == 1 and pool.idle_count == 1
    request = server.requests[0]
    assert request.startswith(b"POST /generate HTTP/1.1\r\n")
    assert b"\r\nContent-Type: application/json\r\n" in request and request.endswith(b'\r\n\r\n{"x":1}')
    pool.close()


async def test_chunked_answer_split_byte_by_byte_with_trailers_and_interim_answer(
    server: ScriptedServer,
) -> None:
    pieces = [b"data: ", b'{"a":1}\n\ndata: [D', b"ONE]\n"]
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\nX-Trailer: t\r\n\r\n"
    )
    server.script = lambda _request: _bytewise(answer)
    pool = UpstreamPool(server.url)
    status, content_type, body = await _read_all(pool)
    assert (status, content_type) == (200, "text/event-stream")
    assert body == b'data: {"a":1}\n\ndata: [DONE]\n'
    assert await _read_all(pool) == (200, "text/event-stream", body)
    assert server.connections == 1
    pool.close()


async def test_body_until_close_and_connection_close_are_not_reused(server: ScriptedServer) -> None:
    server.script = lambda _request: [b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"]
    server.close_after_answer = True
    pool = UpstreamPool(server.url)
    assert await _read_all(pool) == (200, "application/octet-stream", b"all of it")
    assert pool.idle_count == 0
    assert await _read_all(pool) == (200, "application/octet-stream", b"all of it")
    assert server.connections == 2
    pool.close()


async def test_a_stream_cut_mid_chunk_raises_disconnected(server: ScriptedServer) -> None:
    server.script = lambda _request: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel"]
    server.close_after_answer = True
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamError, match="connection lost mid-response") as caught, map_exceptions("POST"):
        await _read_all(pool)
    assert caught.value.retryable
    assert pool.idle_count == 0


async def test_no_answer_at_all_raises_disconnected(server: ScriptedServer) -> None:
    server.script = lambda _request: None
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamDisconnected):
        await _read_all(pool)


async def test_garbage_raises_a_protocol_error(server: ScriptedServer) -> None:
    server.script = lambda _request: [b"SSH-2.0-OpenSSH\r\n\r\n"]
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamProtocolError):
        await _read_all(pool)
    with pytest.raises(UpstreamError, match="unreadable HTTP answer"), map_exceptions("POST"):
        await _read_all(pool)


async def test_an_encoded_answer_is_refused(server: ScriptedServer) -> None:
    server.script = lambda _request: [
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nzz"
    ]
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamProtocolError, match="gzip"):
        await _read_all(pool)


async def test_refused_connection_is_unreachable() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    pool = UpstreamPool(f"http://127.0.0.1:{port}")
    with pytest.raises(UpstreamError, match="cannot connect") as caught, map_exceptions("POST"):
        await _read_all(pool)
    assert caught.value.unreachable and caught.value.retryable


async def test_leaving_early_closes_the_connection(server: ScriptedServer) -> None:
    server.script = lambda _request: [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        *[b"3\r\nabc\r\n"] * 5,
        b"0\r\n\r\n",
    ]
    server.gap_s = 0.02
    pool = UpstreamPool(server.url)
    async with pool.post("/generate", b"{}", {}) as response:
        assert await response.content.readany() == b"abc"
    assert pool.idle_count == 0  # a half-read answer never goes back to the pool
    assert await _read_all(pool) == (200, "application/octet-stream", b"abc" * 5)
    assert server.connections == 2
    pool.close()


async def test_a_large_body_is_read_whole_with_backpressure(server: ScriptedServer) -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, above the high-water mark
    server.script = lambda _request: [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload),
        payload,
    ]
    pool = UpstreamPool(server.url)
    async with pool.post("/generate", b"{}", {}) as response:
        await asyncio.sleep(0.05)  # let the socket fill the buffer: reading pauses
        assert await response.read() == payload
        assert response.content.at_eof()
    assert pool.idle_count == 1
    pool.close()


async def test_header_values_with_line_breaks_are_refused() -> None:
    pool = UpstreamPool("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="line break"):
        pool.post("/generate", b"{}", {"X-SMG-Routing-Key": "a\r\nEvil: 1"})
