"""The one way a generation runs (engines/push_call.py `start_generation`): the same events and errors whether
the call runs without a task (an idle keep-alive connection) or in one, and a call that stops closes its
connection. A scripted loopback server answers with exact bytes; where a case needs its events in separate
reads, the server's `pace` holds each back until the last was handed over. The tests run on a fake-time loop
(looptime): the bounded waits of the pacing cost no real time."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from rolloutgate.engines.base import (
    AssemblyHint,
    EngineFamily,
    UpstreamError,
    UpstreamEvent,
)
from rolloutgate.engines.generation import GenerateDecoder, OpenAIDecoder, push_generation, refuse
from rolloutgate.engines.push_call import start_generation
from rolloutgate.engines.upstream import UpstreamPool

from .scripted import ScriptedServer

pytestmark = pytest.mark.looptime

HINT = AssemblyHint(family=EngineFamily.SGLANG)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _generate_chunk(tokens: int, finished: bool = False) -> bytes:
    finish = {"type": "length", "length": tokens} if finished else None
    item = {"text": "x" * tokens, "meta_info": {"finish_reason": finish, "completion_tokens": tokens}}
    return b"data: " + orjson.dumps(item) + b"\n\n"


def _stream(*events: bytes, done: bool = True) -> list[bytes]:
    body = [_chunk(event) for event in events]
    if done:
        body.append(_chunk(b"data: [DONE]\n\n"))
    return [HEAD, *body, b"0\r\n\r\n"]


class Sink:
    """An `on_events` that keeps the events (and each call's count); with `stop_after`, it stops the call once
    it has that many."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.events: list[UpstreamEvent] = []
        self.calls: list[int] = []
        self._stop_after = stop_after

    def __call__(self, events: list[UpstreamEvent]) -> bool:
        assert events, "never called without events"
        self.events.extend(events)
        self.calls.append(len(events))
        return self._stop_after is None or len(self.events) < self._stop_after


def _summary(events: list[UpstreamEvent]) -> list[tuple[int, str | None]]:
    return [(event.tokens, event.finish_reason) for event in events]


async def _run(pool: UpstreamPool, sink: Sink, body: bytes = b"{}") -> None:
    """One call through `start_generation`: on an idle connection without a task, else in one."""
    ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()
    start_generation(
        pool,
        "/generate",
        lambda: body,
        headers={},
        connect_s=10.0,
        decoder=GenerateDecoder(HINT),
        on_events=sink,
        on_end=ended.set_result,
    )
    error = await ended
    if error is not None:
        raise error


@pytest.fixture(params=["task", "no task"])
async def pool(request: pytest.FixtureRequest, server: ScriptedServer) -> AsyncIterator[UpstreamPool]:
    """The engine's pool, with no idle connection (the call runs in a task) or one (no task)."""
    pool = UpstreamPool(server.url)
    if request.param == "no task":
        server.script = lambda _request: _stream(_generate_chunk(1))
        await _run(pool, Sink())
        assert pool.idle_count == 1
    yield pool
    pool.close()


async def test_both_ways_see_every_event_and_reuse_the_connection(
    server: ScriptedServer, pool: UpstreamPool
) -> None:
    server.script = lambda _request: _stream(
        _generate_chunk(3), _generate_chunk(7), _generate_chunk(9, finished=True)
    )
    sink = Sink()
    await _run(pool, sink)
    assert _summary(sink.events) == [(3, None), (4, None), (2, "length")]
    assert server.connections == 1 and pool.idle_count == 1  # the answer was read to its end: reused


async def test_a_call_that_stops_closes_the_connection(server: ScriptedServer, pool: UpstreamPool) -> None:
    server.script = lambda _request: _stream(*(_generate_chunk(n) for n in range(1, 6)))
    sink = Sink(stop_after=2)
    # one read per event: the next once the last was handed over (the head is the first piece)
    server.pace = lambda written: len(sink.events) >= written - 1
    connections = server.connections
    await _run(pool, sink)
    assert len(sink.events) == 2
    server.pace = None
    await _run(pool, Sink())
    assert server.connections == max(connections, 1) + 1  # the stopped call's connection was not reused


async def test_a_stream_cut_before_done_and_an_error_event_fail_the_call(
    server: ScriptedServer, pool: UpstreamPool
) -> None:
    server.script = lambda _request: _stream(_generate_chunk(2), done=False)
    with pytest.raises(UpstreamError, match="before \\[DONE\\]") as cut:
        await _run(pool, Sink())
    assert cut.value.retryable
    error = b'data: {"error": {"message": "out of memory", "code": 503}}\n\n'
    server.script = lambda _request: _stream(_generate_chunk(2), error)
    sink = Sink()
    with pytest.raises(UpstreamError, match="out of memory") as failed:
        await _run(pool, sink)
    assert failed.value.status == 503 and failed.value.retryable
    assert len(sink.events) == 1


async def test_a_whole_body_answer_is_one_event(server: ScriptedServer, pool: UpstreamPool) -> None:
    body = orjson.dumps(
        {"text": "abc", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "stop"}}}
    )
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    server.script = lambda _request: [head + body]
    sink = Sink()
    await _run(pool, sink)
    summary = [(e.is_whole_body, e.tokens, e.finish_reason, e.data) for e in sink.events]
    assert summary == [(True, 3, "stop", body)]


async def test_the_request_body_is_not_held_while_the_answer_streams(server: ScriptedServer) -> None:
    """A 100K-token prompt is ~600 KB: a call must not keep its request bytes while the answer streams."""
    server.script = lambda _request: _stream(_generate_chunk(1))
    pool = UpstreamPool(server.url)
    body = b'{"prompt": "' + b"x" * 1000 + b'"}'
    alone = sys.getrefcount(body)  # this frame's reference (and the call's argument)
    references: list[int] = []

    def on_events(events: list[UpstreamEvent]) -> bool:
        references.append(sys.getrefcount(body))
        return True

    await push_generation(
        pool,
        "/generate",
        body,
        headers={},
        connect_s=10.0,
        decoder=GenerateDecoder(HINT),
        on_events=on_events,
    )
    assert references == [alone]
    pool.close()


async def test_a_refused_call_reports_its_error_soon_and_a_cancelled_one_nothing() -> None:
    error = UpstreamError("no /generate here", retryable=False, status=400)
    reported: list[UpstreamError | None] = []
    refuse(error, reported.append)
    cancelled = refuse(error, reported.append)
    cancelled.cancel()
    assert reported == []  # never from inside the call that started it
    await asyncio.sleep(0)
    assert reported == [error] and cancelled.done()


def test_openai_decoder_marks_the_usage_frame_the_client_did_not_ask_for() -> None:
    decoder = OpenAIDecoder(HINT, wants_usage=False)
    token = decoder.decode(b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}')
    usage = decoder.decode(b'{"choices":[],"usage":{"completion_tokens":3}}')
    assert (token.tokens, token.is_gateway_only) == (1, False)
    assert (usage.tokens, usage.is_gateway_only) == (2, True)
    wanted = OpenAIDecoder(HINT, wants_usage=True).decode(b'{"choices":[],"usage":{"completion_tokens":1}}')
    assert (wanted.tokens, wanted.is_gateway_only) == (1, False)
