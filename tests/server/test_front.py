"""The front's body reading (server/front.py `read_body`): a body that came with its headers, and one that
comes later in pieces, read the same, each within the limit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rolloutgate.errors import PayloadTooLarge
from rolloutgate.server.front import _RequestIds, read_body

LIMIT = 64


@pytest.fixture
async def served() -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A server answering with what read_body returned (or the error's name); `started` is set once a
    handler runs (its headers were read)."""
    started = asyncio.Event()

    async def handler(request: web.Request) -> web.Response:
        started.set()
        try:
            body = await read_body(request, LIMIT)
        except PayloadTooLarge:
            return web.Response(text="too large")
        return web.Response(body=b"read:" + body)

    app = web.Application()
    app.router.add_post("/", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    assert server.port is not None
    yield server.port, started
    await server.close()


async def _post(port: int, head: bytes, pieces: list[bytes], started: asyncio.Event | None) -> bytes:
    """Write the head, then (after the handler started, when `started` is given) the body pieces."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + (b"" if started else b"".join(pieces)))
    await writer.drain()
    if started is not None:
        await started.wait()  # the handler runs before the body is sent: read_body must wait for it
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer.partition(b"\r\n\r\n")[2]


def _head(length: int | None) -> bytes:
    framing = b"Content-Length: %d" % length if length is not None else b"Transfer-Encoding: chunked"
    return b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + framing + b"\r\n\r\n"


def _chunks(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]


async def test_a_body_that_came_with_its_headers(served: tuple[int, asyncio.Event]) -> None:
    port, _ = served
    assert await _post(port, _head(5), [b"hello"], None) == b"read:hello"
    assert await _post(port, _head(None), _chunks(b"a" * LIMIT), None) == b"read:" + b"a" * LIMIT
    assert await _post(port, _head(None), _chunks(b"a" * (LIMIT + 1)), None) == b"too large"
    assert await _post(port, _head(LIMIT + 1), [b"a" * (LIMIT + 1)], None) == b"too large"


async def test_a_body_that_comes_after_the_headers(served: tuple[int, asyncio.Event]) -> None:
    port, started = served
    assert await _post(port, _head(5), [b"hel", b"lo"], started) == b"read:hello"
    started.clear()
    assert await _post(port, _head(None), _chunks(b"a" * 40, b"b" * 30), started) == b"too large"


def test_request_ids_are_32_hex_digits_unique_and_distinct_per_process() -> None:
    ids = _RequestIds()
    seen = {ids() for _ in range(10_000)}
    assert len(seen) == 10_000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in seen)
    other = _RequestIds()  # another gateway process: another prefix
    assert {i[:16] for i in seen} != {other()[:16]}
