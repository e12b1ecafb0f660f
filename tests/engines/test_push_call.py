"""A pushed generation without a task (engines/push_call.py): each way an answer can end, on a scripted engine.

Where a case needs pieces of the answer in separate reads, or after the call reported something, the scripted
server's `pace` holds the next piece back until then. The tests run on a fake-time loop (looptime): the drain
limit passes in fake seconds, and the bounded waits cost no real time.
"""

from __future__ import annotations

import asyncio
import gc
import re
import weakref
from collections.abc import Callable

import orjson
import pytest

from rolloutgate.engines import push_call
from rolloutgate.engines.base import AssemblyHint, EngineFamily, UpstreamError, UpstreamEvent
from rolloutgate.engines.generation import GenerateDecoder
from rolloutgate.engines.push_call import PushedGeneration, start_push_generation
from rolloutgate.engines.upstream import UpstreamPool
from tests.sim.helpers import wait_until

from .scripted import ScriptedServer

pytestmark = pytest.mark.looptime

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(tokens: int, finish: str | None = None) -> bytes:
    reason = {"type": finish} if finish else None
    payload = {"text": "t" * tokens, "meta_info": {"completion_tokens": tokens, "finish_reason": reason}}
    return chunk(b"data: " + orjson.dumps(payload) + b"\n\n")


DONE = chunk(b"data: [DONE]\n\n")


def json_answer(status: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )


class Call:
    """One call's observations: the events handed over, and its outcome."""

    def __init__(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        self.events: list[UpstreamEvent] = []
        self.ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()
        self.ends = 0
        self.reads = 0  # calls of on_events: one per read that brought events
        self._keep_going = keep_going

    def on_events(self, events: list[UpstreamEvent]) -> bool:
        self.events += events
        self.reads += 1
        return self._keep_going()

    def one_read_per_piece(self, written: int) -> bool:
        """The server's `pace`: the next piece once the last one was handed over (one read each)."""
        return self.reads >= written

    def on_end(self, error: UpstreamError | None) -> None:
        self.ends += 1
        self.ended.set_result(error)

    async def outcome(self) -> UpstreamError | None:
        return await asyncio.wait_for(asyncio.shield(self.ended), 5)


async def warm(pool: UpstreamPool, server: ScriptedServer) -> None:
    """One plain call, so the pool holds an idle connection."""
    script = server.script
    server.script = lambda _request: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
    async with pool.post("/generate", b"{}", {}) as response:
        assert await response.read() == b"ok"
    server.script = script
    assert pool.idle_count == 1


def start(pool: UpstreamPool, call: Call) -> PushedGeneration | None:
    return start_push_generation(
        pool,
        "/generate",
        lambda: b'{"input_ids":[1]}',
        headers={"X-SMG-Routing-Key": "k"},
        decoder=GenerateDecoder(AssemblyHint(family=EngineFamily.SGLANG)),
        on_events=call.on_events,
        on_end=call.on_end,
    )


@pytest.fixture
async def pool(server: ScriptedServer) -> UpstreamPool:
    return UpstreamPool(server.url)


async def test_without_an_idle_connection_the_caller_runs_a_task(pool: UpstreamPool) -> None:
    assert start(pool, Call()) is None


async def test_a_stream_to_its_end_in_one_read(pool: UpstreamPool, server: ScriptedServer) -> None:
    server.script = lambda _request: [HEAD + event(1) + event(3, "length") + DONE + END]
    await warm(pool, server)
    call = Call()
    handle = start(pool, call)
    assert handle is not None and not handle.done()
    assert await call.outcome() is None
    assert [e.tokens for e in call.events] == [1, 2] and handle.done()
    assert pool.idle_count == 1 and server.connections == 1  # reused, and back in the pool
    request = server.requests[-1]
    assert request.startswith(b"POST /generate HTTP/1.1\r\n") and b"X-SMG-Routing-Key: k\r\n" in request
    assert request.endswith(b'{"input_ids":[1]}') and b"Content-Type: application/json" in request


async def test_the_terminator_after_done_is_drained_before_reuse(
    pool: UpstreamPool, server: ScriptedServer
) -> None:
    server.script = lambda _request: [HEAD + event(2, "stop") + DONE, END]
    await warm(pool, server)
    call = Call()
    server.pace = lambda _written: call.ended.done()  # the terminator after the outcome, in a read of its own
    start(pool, call)
    assert await call.outcome() is None  # the answer is complete at [DONE]
    assert pool.idle_count == 0  # still draining
    await wait_until(lambda: pool.idle_count == 1, "back in the pool")  # once the terminator is read
    assert server.connections == 1 and server.closed == 0


async def test_a_terminator_that_never_comes_closes_the_connection(
    pool: UpstreamPool, server: ScriptedServer
) -> None:
    server.script = lambda _request: [HEAD + event(2, "stop") + DONE]  # and then nothing: the engine hangs
    await warm(pool, server)
    call = Call()
    start(pool, call)
    assert await call.outcome() is None
    loop = asyncio.get_running_loop()
    reported = loop.time()
    limit_s = push_call.DRAIN_AFTER_DONE_S
    await wait_until(lambda: server.closed == 1, "the server saw the connection close", timeout_s=2 * limit_s)
    assert limit_s <= loop.time() - reported <= limit_s + 0.05  # fake seconds: closed at the drain limit
    assert server.connections == 1 and pool.idle_count == 0  # closed, not reused


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (HEAD + event(1) + END, "ended before \\[DONE\\]"),
        (HEAD + chunk(b'data: {"text":') + END, "ended inside an event"),
        (HEAD + chunk(b'data: {"error": {"message": "boom"}}\n\n') + END, "boom"),
        (HEAD + event(1) + b"zz\r\n", "unreadable"),
    ],
    ids=["no-done", "cut-event", "error-event", "garbage"],
)
async def test_a_failed_stream_ends_with_its_error_and_closes(
    pool: UpstreamPool, server: ScriptedServer, answer: bytes, message: str
) -> None:
    server.script = lambda _request: [answer]
    await warm(pool, server)
    call = Call()
    start(pool, call)
    error = await call.outcome()
    assert error is not None and error.retryable
    assert re.search(message, error.message), error.message
    assert pool.idle_count == 0 and call.ends == 1


async def test_a_connection_lost_mid_stream(pool: UpstreamPool, server: ScriptedServer) -> None:
    await warm(pool, server)
    server.script = lambda _request: [HEAD + event(1)]
    server.close_after_answer = True  # after this answer (the warm-up's connection stays open)
    call = Call()
    start(pool, call)
    error = await call.outcome()
    assert error is not None and "connection lost" in error.message and error.retryable
    assert [e.tokens for e in call.events] == [1]


async def test_an_error_status_is_read_as_push_generation_reads_it(
    pool: UpstreamPool, server: ScriptedServer
) -> None:
    body = b'{"error": {"message": "queue full"}}'
    server.script = lambda _request: [json_answer(b"503 Service Unavailable", body)]
    await warm(pool, server)
    call = Call()
    start(pool, call)
    error = await call.outcome()
    assert error is not None and error.status == 503 and "queue full" in error.message
    assert call.events == []


async def test_a_whole_json_answer_is_one_event(pool: UpstreamPool, server: ScriptedServer) -> None:
    body = orjson.dumps(
        {"text": "abc", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "stop"}}}
    )
    server.script = lambda _request: [json_answer(b"200 OK", body)]
    await warm(pool, server)
    call = Call()
    start(pool, call)
    assert await call.outcome() is None
    assert len(call.events) == 1 and call.events[0].is_whole_body and call.events[0].tokens == 3
    await wait_until(lambda: pool.idle_count == 1, "back in the pool")


async def test_a_sink_that_stops_closes_the_connection(pool: UpstreamPool, server: ScriptedServer) -> None:
    server.script = lambda _request: [HEAD + event(1), event(2), event(3, "stop") + DONE + END]
    await warm(pool, server)
    call = Call(keep_going=lambda: False)
    server.pace = call.one_read_per_piece
    start(pool, call)
    assert await call.outcome() is None  # the driver ignores what a stale attempt reports
    assert [e.tokens for e in call.events] == [1]
    assert pool.idle_count == 0


async def test_a_cancelled_call_reports_nothing_and_closes(
    pool: UpstreamPool, server: ScriptedServer
) -> None:
    server.script = lambda _request: [HEAD, *[event(n) for n in range(1, 40)], DONE + END]
    await warm(pool, server)
    call = Call()
    # one read per event: the next once the last was handed over (the head is the first piece)
    server.pace = lambda written: len(call.events) >= written - 1
    handle = start(pool, call)
    assert handle is not None
    await wait_until(lambda: len(call.events) > 0, "an event")
    handle.cancel()
    assert handle.done()
    count = len(call.events)
    # the server writes the rest of its answer (as an engine does until it notices) and sees the close
    await wait_until(lambda: server.closed == 1, "the server saw the connection close")
    assert len(call.events) == count and not call.ended.done()  # nothing after the cancel
    assert pool.idle_count == 0


async def test_a_finished_call_leaves_no_reference_cycle(pool: UpstreamPool, server: ScriptedServer) -> None:
    """The driver's exchange holds the call's handle, and the call's sink leads back to the exchange: once
    the outcome is reported, the call lets go, so the exchange is freed at once, not by the cyclic collector."""
    server.script = lambda _request: [HEAD + event(2, "stop") + DONE + END]
    await warm(pool, server)
    call = Call()
    call.handle = start(pool, call)  # type: ignore[attr-defined]  # as Exchange.upstream_task holds it
    assert await call.outcome() is None
    gone = weakref.ref(call)
    gc.disable()
    try:
        del call
        assert gone() is None
    finally:
        gc.enable()
