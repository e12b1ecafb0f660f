"""One generation call, pulled and pushed (engines/generation.py): the same events either way, the same errors,
and a push that stops closes the connection.

A scripted loopback server answers with exact bytes; the call goes through the lean pool (push) or aiohttp
(push emulated with batches), and the pulled iterator is the reference.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from rolloutgate.engines.base import (
    AssemblyHint,
    EngineFamily,
    Route,
    UpstreamCall,
    UpstreamError,
    UpstreamEvent,
)
from rolloutgate.engines.generation import (
    GenerateDecoder,
    OpenAIDecoder,
    deliver,
    pull_generation,
    pull_into,
    push_generation,
)
from rolloutgate.engines.http import ControlTimeouts
from rolloutgate.engines.upstream import UpstreamPool

from .scripted import ScriptedServer

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


async def _pull(url: str, session: aiohttp.ClientSession, pool: UpstreamPool | None) -> list[UpstreamEvent]:
    events = pull_generation(
        session,
        pool,
        url + "/generate",
        b"{}",
        headers={},
        timeouts=ControlTimeouts(),
        decoder=GenerateDecoder(HINT),
    )
    return [event async for event in events]


async def _push(url: str, session: aiohttp.ClientSession, pool: UpstreamPool | None, sink: Sink) -> None:
    await push_generation(
        session,
        pool,
        url + "/generate",
        b"{}",
        headers={},
        timeouts=ControlTimeouts(),
        decoder=GenerateDecoder(HINT),
        on_events=sink,
    )


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "aiohttp"])
async def test_push_and_pull_see_the_same_events(
    server: ScriptedServer, session: aiohttp.ClientSession, lean: bool
) -> None:
    server.script = lambda _request: _stream(
        _generate_chunk(3), _generate_chunk(7), _generate_chunk(9, finished=True)
    )
    pool = UpstreamPool(server.url) if lean else None
    pulled = await _pull(server.url, session, pool)
    sink = Sink()
    await _push(server.url, session, pool, sink)
    assert _summary(sink.events) == _summary(pulled) == [(3, None), (4, None), (2, "length")]
    assert [e.data for e in sink.events] == [e.data for e in pulled]
    if pool is not None:
        assert server.connections == 1 and pool.idle_count == 1  # both answers read to the end: reused
        pool.close()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "aiohttp"])
async def test_a_push_that_stops_closes_the_connection(
    server: ScriptedServer, session: aiohttp.ClientSession, lean: bool
) -> None:
    server.script = lambda _request: _stream(*(_generate_chunk(n) for n in range(1, 6)))
    server.gap_s = 0.01
    pool = UpstreamPool(server.url) if lean else None
    sink = Sink(stop_after=2)
    await _push(server.url, session, pool, sink)
    assert len(sink.events) == 2
    await _push(server.url, session, pool, Sink())
    assert server.connections == 2  # the stopped call's connection was closed, not reused
    if pool is not None:
        pool.close()


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "aiohttp"])
async def test_a_stream_cut_before_done_and_an_error_event_raise(
    server: ScriptedServer, session: aiohttp.ClientSession, lean: bool
) -> None:
    pool = UpstreamPool(server.url) if lean else None
    server.script = lambda _request: _stream(_generate_chunk(2), done=False)
    with pytest.raises(UpstreamError, match="before \\[DONE\\]") as cut:
        await _push(server.url, session, pool, Sink())
    assert cut.value.retryable
    error = b'data: {"error": {"message": "out of memory", "code": 503}}\n\n'
    server.script = lambda _request: _stream(_generate_chunk(2), error)
    sink = Sink()
    with pytest.raises(UpstreamError, match="out of memory") as failed:
        await _push(server.url, session, pool, sink)
    assert failed.value.status == 503 and failed.value.retryable
    assert len(sink.events) == 1
    if pool is not None:
        pool.close()


async def test_a_whole_body_answer_is_one_event(
    server: ScriptedServer, session: aiohttp.ClientSession
) -> None:
    body = orjson.dumps(
        {"text": "abc", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "stop"}}}
    )
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    server.script = lambda _request: [head + body]
    pool = UpstreamPool(server.url)
    sink = Sink()
    await _push(server.url, session, pool, sink)
    summary = [(e.is_whole_body, e.tokens, e.finish_reason, e.data) for e in sink.events]
    assert summary == [(True, 3, "stop", body)]
    pool.close()


async def test_the_request_body_is_not_held_while_the_answer_streams(
    server: ScriptedServer, session: aiohttp.ClientSession
) -> None:
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
        session,
        pool,
        server.url + "/generate",
        body,
        headers={},
        timeouts=ControlTimeouts(),
        decoder=GenerateDecoder(HINT),
        on_events=on_events,
    )
    assert references == [alone]
    pool.close()


def test_openai_decoder_marks_the_usage_frame_the_client_did_not_ask_for() -> None:
    decoder = OpenAIDecoder(HINT, wants_usage=False)
    token = decoder.decode(b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}')
    usage = decoder.decode(b'{"choices":[],"usage":{"completion_tokens":3}}')
    assert (token.tokens, token.is_gateway_only) == (1, False)
    assert (usage.tokens, usage.is_gateway_only) == (2, True)
    wanted = OpenAIDecoder(HINT, wants_usage=True).decode(b'{"choices":[],"usage":{"completion_tokens":1}}')
    assert (wanted.tokens, wanted.is_gateway_only) == (1, False)


class _PullOnly:
    """An engine client without `stream_into`: deliver() falls back to its iterator."""

    def __init__(self, events: list[UpstreamEvent]) -> None:
        self._events = events
        self.closed = False

    def generate(self, call: UpstreamCall) -> AsyncIterator[UpstreamEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[UpstreamEvent]:
        try:
            for event in self._events:
                yield event
        finally:
            self.closed = True


async def test_deliver_pulls_from_a_client_that_cannot_push_and_closes_it_on_stop() -> None:
    events = [UpstreamEvent(data=b"{}", tokens=n) for n in (1, 2, 3)]
    client = _PullOnly(events)
    call = UpstreamCall(request_id="r", route=Route.GENERATE, body={})
    sink = Sink(stop_after=2)
    await deliver(client, call, sink)
    assert [e.tokens for e in sink.events] == [1, 2] and client.closed
    whole = Sink()
    await pull_into(_PullOnly(events).generate(call), whole)
    assert [e.tokens for e in whole.events] == [1, 2, 3]
