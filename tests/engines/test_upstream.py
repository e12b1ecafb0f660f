"""The lean generation client (engines/upstream.py, upstream_wire.py): framing, reuse, failures, push.

A scripted loopback server answers each request with raw bytes, so every framing case is exact; where a case
needs pieces in separate reads, or after the client did something, the server's `pace` holds the next piece
back until then. The tests run on a fake-time loop (looptime): the idle limit passes in fake seconds, and the
bounded waits cost no real time.
"""

from __future__ import annotations

import asyncio

import pytest

from rolloutgate.engines import upstream, upstream_wire
from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.http import map_exceptions
from rolloutgate.engines.upstream import (
    UpstreamAnswer,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamProtocolError,
)
from tests.sim.helpers import wait_until

from .scripted import ScriptedServer, bytewise

pytestmark = pytest.mark.looptime


async def _read_all(pool: UpstreamPool, path: str = "/generate") -> tuple[int, str, bytes]:
    async with pool.post(path, b'{"x":1}', {"Content-Type": "application/json"}) as response:
        return response.status, response.content_type, await response.read()


async def test_content_length_answer_and_the_connection_is_reused(server: ScriptedServer) -> None:
    pool = UpstreamPool(server.url)
    for _ in range(3):
        assert await _read_all(pool) == (200, "", b"ok")
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
    server.script = lambda _request: bytewise(answer)
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
    assert await _read_all(pool) == (200, "", b"all of it")
    assert pool.idle_count == 0
    assert await _read_all(pool) == (200, "", b"all of it")
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
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    # the first answer stops after its first chunk (nothing else can be read before leaving), the next is whole
    answers = iter([[head, b"3\r\nabc\r\n"], [head, *[b"3\r\nabc\r\n"] * 5, b"0\r\n\r\n"]])
    server.script = lambda _request: next(answers)
    pool = UpstreamPool(server.url)
    async with pool.post("/generate", b"{}", {}) as response:
        assert await response.readany() == b"abc"
    assert pool.idle_count == 0  # a half-read answer never goes back to the pool
    assert await _read_all(pool) == (200, "", b"abc" * 5)
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
        # nothing is read yet: the body queues up to the high-water mark, and then reading the socket pauses
        await wait_until(lambda: _connection(response)._is_paused, "reading paused above the high-water mark")
        assert await response.read() == payload
        assert not _connection(response)._is_paused  # resumed once read
    assert pool.idle_count == 1
    pool.close()


async def test_header_values_with_line_breaks_are_refused() -> None:
    pool = UpstreamPool("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="line break"):
        pool.post("/generate", b"{}", {"X-SMG-Routing-Key": "a\r\nEvil: 1"})


def _connection(response: UpstreamAnswer) -> upstream_wire.UpstreamConnection:
    """The connection under an answer: its reading state has no public view."""
    return response._connection


# -- idle connections and push delivery ---------------------------------------------------------------------


class Collected:
    """A push sink that keeps every piece (`keep`) or only the first (`first`: it stops there)."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def keep(self, piece: bytes) -> bool:
        self.pieces.append(piece)
        return True

    def first(self, piece: bytes) -> bool:
        self.pieces.append(piece)
        return False

    def one_read_per_piece(self, written: int) -> bool:
        """The server's `pace`: the next piece once the last one reached the sink (the head is the first)."""
        return len(self.pieces) >= written - 1


async def _push_all(pool: UpstreamPool, seen: Collected, pushing: asyncio.Event | None = None) -> None:
    """POST and push the whole answer into `seen` (`pushing` is set once the push has started)."""
    async with pool.post("/generate", b"{}", {}) as response:
        try:
            push = response.start_push(seen.keep)
            if pushing is not None:
                pushing.set()
            await push
        finally:
            response.stop_push()


def _chunked(*pieces: bytes, end: bytes = b"0\r\n\r\n") -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head, *(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), end]


async def test_an_idle_connection_older_than_the_limit_is_not_reused(server: ScriptedServer) -> None:
    pool = UpstreamPool(server.url)
    assert await _read_all(pool) == (200, "", b"ok")
    await asyncio.sleep(upstream._MAX_IDLE_S - 0.1)  # fake seconds
    assert await _read_all(pool) == (200, "", b"ok")
    assert server.connections == 1  # fresh enough: reused
    await asyncio.sleep(upstream._MAX_IDLE_S + 0.1)
    assert await _read_all(pool) == (200, "", b"ok")
    assert server.connections == 2 and pool.idle_count == 1  # too old: closed, and a new one made
    assert server.closed == 1
    pool.close()


async def test_push_hands_each_piece_over_as_it_arrives_and_the_connection_is_reused(
    server: ScriptedServer,
) -> None:
    server.script = lambda _request: _chunked(b"one", b"two", b"three")
    pool = UpstreamPool(server.url)
    for _ in range(2):
        seen = Collected()
        server.pace = seen.one_read_per_piece
        async with pool.post("/generate", b"{}", {}) as response:
            try:
                await response.start_push(seen.keep)
            finally:
                response.stop_push()
            assert seen.pieces == [b"one", b"two", b"three"]
    assert server.connections == 1 and pool.idle_count == 1
    pool.close()


async def test_push_hands_the_chunks_of_one_read_over_together(server: ScriptedServer) -> None:
    """A streaming answer's tokens arrive several to a read: the sink gets them in one piece, so the driver
    reports them to the core once."""
    head, *chunks = _chunked(b"one", b"two", b"three")
    server.script = lambda _request: [head, b"".join(chunks)]  # the body in one write, after the head
    pool = UpstreamPool(server.url)
    seen = Collected()
    pushing = asyncio.Event()
    server.pace = lambda _written: pushing.is_set()  # the body is written once the push has started
    await _push_all(pool, seen, pushing)
    assert seen.pieces == [b"onetwothree"]
    assert pool.idle_count == 1
    pool.close()


async def test_a_read_that_ends_in_garbage_hands_over_what_came_before_it(server: ScriptedServer) -> None:
    head, first, *_ = _chunked(b"good")
    server.script = lambda _request: [head, first + b"zz\r\n"]  # a chunk, then no chunk size
    pool = UpstreamPool(server.url)
    seen = Collected()
    pushing = asyncio.Event()
    server.pace = lambda _written: pushing.is_set()  # the body is written once the push has started
    with pytest.raises(UpstreamProtocolError):
        await _push_all(pool, seen, pushing)
    assert seen.pieces == [b"good"]
    assert pool.idle_count == 0
    pool.close()


async def test_push_takes_what_was_queued_before_it_started(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(b"early", b"late")
    pool = UpstreamPool(server.url)
    seen = Collected()
    async with pool.post("/generate", b"{}", {}) as response:
        # both pieces and the end are queued before the push starts
        await wait_until(lambda: _connection(response)._state == upstream_wire._DONE, "the whole answer")
        await response.start_push(seen.keep)
        response.stop_push()
    assert b"".join(seen.pieces) == b"earlylate"
    assert pool.idle_count == 1
    pool.close()


async def test_a_sink_that_stops_ends_the_push_and_the_connection_is_closed(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(b"first", b"second", b"third")
    pool = UpstreamPool(server.url)
    seen = Collected()
    server.pace = seen.one_read_per_piece
    async with pool.post("/generate", b"{}", {}) as response:
        await response.start_push(seen.first)
        response.stop_push()
    assert seen.pieces == [b"first"]
    assert pool.idle_count == 0  # a half-read answer is closed: how vLLM learns its client left
    pool.close()


async def test_a_sink_that_raises_fails_the_push_with_its_error(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(b"bad")
    pool = UpstreamPool(server.url)

    def refuse(piece: bytes) -> bool:
        raise UpstreamError(f"refused {piece!r}", retryable=True)

    with pytest.raises(UpstreamError, match="refused"):
        async with pool.post("/generate", b"{}", {}) as response:
            try:
                await response.start_push(refuse)
            finally:
                response.stop_push()
    assert pool.idle_count == 0
    pool.close()


async def test_a_push_cut_mid_body_raises_disconnected(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(b"part", end=b"")
    server.close_after_answer = True
    pool = UpstreamPool(server.url)
    seen = Collected()
    with pytest.raises(UpstreamDisconnected):
        async with pool.post("/generate", b"{}", {}) as response:
            await response.start_push(seen.keep)
    assert seen.pieces == [b"part"]
    pool.close()


async def test_a_cancelled_push_closes_its_connection(server: ScriptedServer) -> None:
    """A generation whose client left is cancelled: its connection must close (vLLM aborts a generation only
    when its connection closes), never go back to the pool."""
    server.script = lambda _request: _chunked(*[b"token"] * 50)
    pool = UpstreamPool(server.url)
    seen = Collected()
    server.pace = seen.one_read_per_piece

    async def generation() -> None:
        async with pool.post("/generate", b"{}", {}) as response:
            try:
                await response.start_push(seen.keep)
            finally:
                response.stop_push()

    task = asyncio.create_task(generation())
    await wait_until(lambda: len(seen.pieces) >= 3, "three pieces pushed")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(seen.pieces) < 50
    assert pool.idle_count == 0
    count = len(seen.pieces)
    # the server writes the rest of its answer (as an engine does until it notices) and sees the close
    await wait_until(lambda: server.closed == 1, "the server saw the connection close")
    assert len(seen.pieces) == count  # nothing is delivered after the cancel
    pool.close()


# -- a push armed before the answer (`post(..., push_to=sink)`) ---------------------------------------------


async def test_an_armed_push_takes_the_body_from_the_read_of_the_head(server: ScriptedServer) -> None:
    """The head and the whole body in one read (the usual fast answer): the body is pushed in that read and
    the response comes with the push over; the connection goes back to the pool."""
    server.script = lambda _request: [b"".join(_chunked(b"one", b"two"))]
    pool = UpstreamPool(server.url)
    for _ in range(2):
        seen = Collected()
        async with pool.post("/generate", b"{}", {}, push_to=seen.keep) as response:
            assert response.pushed and response.status == 200
            assert seen.pieces == [b"onetwo"]
            response.stop_push()
        assert server.connections == 1 and pool.idle_count == 1
    pool.close()


async def test_an_armed_push_follows_a_body_split_over_reads(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(b"one", b"two", b"three")
    pool = UpstreamPool(server.url)
    seen = Collected()
    server.pace = seen.one_read_per_piece
    async with pool.post("/generate", b"{}", {}, push_to=seen.keep) as response:
        assert response.pushed
        response.stop_push()
    assert seen.pieces == [b"one", b"two", b"three"]
    assert pool.idle_count == 1
    pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/event-stream\r\nContent-Length: 4\r\n\r\nbusy",
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\nbusy",
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: 0\r\n\r\n",
    ],
    ids=["error-status", "not-a-stream", "empty-stream"],
)
async def test_an_answer_that_is_not_a_200_stream_is_not_pushed(
    server: ScriptedServer, answer: bytes
) -> None:
    server.script = lambda _request: [answer]
    pool = UpstreamPool(server.url)
    seen = Collected()
    async with pool.post("/generate", b"{}", {}, push_to=seen.keep) as response:
        assert not response.pushed
        body = await response.read()
    assert seen.pieces == []  # read as without the sink
    assert body == answer.partition(b"\r\n\r\n")[2]
    pool.close()


async def test_an_armed_push_raises_its_failures_from_the_post(server: ScriptedServer) -> None:
    """A sink's error and a connection cut mid-body raise where the response would have come, and the
    connection is closed, never reused."""
    server.script = lambda _request: _chunked(b"bad")
    pool = UpstreamPool(server.url)

    def refuse(piece: bytes) -> bool:
        raise UpstreamError(f"refused {piece!r}", retryable=True)

    with pytest.raises(UpstreamError, match="refused"):
        async with pool.post("/generate", b"{}", {}, push_to=refuse):
            pytest.fail("the push failed: no response")
    assert pool.idle_count == 0
    server.script = lambda _request: _chunked(b"part", end=b"")
    server.close_after_answer = True
    seen = Collected()
    with pytest.raises(UpstreamDisconnected):
        async with pool.post("/generate", b"{}", {}, push_to=seen.keep):
            pytest.fail("the push failed: no response")
    assert seen.pieces == [b"part"] and pool.idle_count == 0
    pool.close()


async def test_a_cancelled_armed_push_closes_its_connection(server: ScriptedServer) -> None:
    server.script = lambda _request: _chunked(*[b"token"] * 50)
    pool = UpstreamPool(server.url)
    seen = Collected()
    server.pace = seen.one_read_per_piece

    async def generation() -> None:
        async with pool.post("/generate", b"{}", {}, push_to=seen.keep):
            pass

    task = asyncio.create_task(generation())
    await wait_until(lambda: len(seen.pieces) >= 3, "three pieces pushed")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    count = len(seen.pieces)
    assert 0 < count < 50 and pool.idle_count == 0
    await wait_until(lambda: server.closed == 1, "the server saw the connection close")
    assert len(seen.pieces) == count  # nothing is delivered after the cancel
    pool.close()


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "byte-by-byte"])
async def test_a_chunk_without_its_crlf_is_refused(server: ScriptedServer, split: bool) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY0\r\n\r\n"
    server.script = lambda _request: bytewise(answer) if split else [answer]
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamProtocolError, match="after chunk data"):
        await _read_all(pool)
    pool.close()
