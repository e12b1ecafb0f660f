"""SSE framing, error mapping and small helpers (engines/http.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutgate.engines.base import AssemblyHint, EngineFamily, UpstreamError, UpstreamEvent
from rolloutgate.engines.http import (
    ControlTimeouts,
    SseParser,
    check_json_object,
    is_error_frame,
    map_exceptions,
    parse_prometheus,
    raise_for_error_frame,
    status_error,
)
from rolloutgate.engines.push_call import start_generation
from rolloutgate.engines.upstream import UpstreamPool

from .fakes import FakeEngine, sse_reply


def parse_all(chunks: list[bytes]) -> tuple[list[bytes], bytes | None]:
    parser = SseParser()
    events = [data for chunk in chunks for data in parser.feed(chunk)]
    return events, parser.finish()


# -- SseParser ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b'data: {"a":1}\n\n'], [b'{"a":1}']),
        ([b'data: {"a":1}\n\ndata: {"b":2}\n\n'], [b'{"a":1}', b'{"b":2}']),
        ([b'data: {"a"', b":1}\n", b"\ndata: x\n\n"], [b'{"a":1}', b"x"]),  # event split, separator split
        ([b"data: a\r\n\r\ndata: b\r\n\r\n"], [b"a", b"b"]),  # CRLF
        ([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"], [b"a", b"b"]),  # CR and LF in different chunks
        ([b": keep-alive\n\ndata: a\n\n"], [b"a"]),  # a comment-only event is skipped
        ([b": ping\ndata: a\n\n"], [b"a"]),  # a comment line inside an event
        ([b"data: line1\ndata: line2\n\n"], [b"line1\nline2"]),  # multi-line data joins with \n
        ([b"data:nospace\n\n"], [b"nospace"]),  # the space after the colon is optional
        ([b"event: message\nid: 3\nretry: 10\ndata: a\n\n"], [b"a"]),  # other fields ignored
        ([b"\n\n\n\ndata: a\n\n\n"], [b"a"]),  # stray blank lines
        ([b"data: a\r\rdata: b\r\r"], [b"a", b"b"]),  # lone CR line ends
    ],
)
def test_parser_splits_events(chunks: list[bytes], expected: list[bytes]) -> None:
    events, tail = parse_all(chunks)
    assert events == expected
    assert tail is None


def test_parser_returns_an_unterminated_last_event_from_finish() -> None:
    events, tail = parse_all([b"data: a\n\ndata: [DONE]\n"])
    assert events == [b"a"]
    assert tail == b"[DONE]"
    assert parse_all([b'data: {"cut'])[1] == b'{"cut'
    assert parse_all([b"data: a\r"]) == ([], b"a")


def test_parser_copies_a_large_event_once_per_completion() -> None:
    big = b"data: " + b"x" * 300_000 + b"\n\n"
    pieces = [big[i : i + 65536] for i in range(0, len(big), 65536)]
    events, _ = parse_all(pieces)
    assert events == [b"x" * 300_000]


def test_parser_refuses_an_event_that_never_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken engine that never ends its event costs a bounded buffer, then a retryable fault; the events
    before it were delivered, and a parser reused after the fault starts clean."""
    monkeypatch.setattr("rolloutgate.engines.http.MAX_SSE_EVENT_BYTES", 100_000)
    parser = SseParser()
    assert parser.feed(b"data: ok\n\ndata: " + b"x" * 40_000) == [b"ok"]
    parser.feed(b"x" * 40_000)
    with pytest.raises(UpstreamError, match="without ending it") as failure:
        parser.feed(b"x" * 40_000)
    assert failure.value.retryable
    assert parser.finish() is None  # the oversized event was dropped, not kept
    lines = b"data: a\n" * 20_000  # many lines, never a blank one: still one event that never ends
    with pytest.raises(UpstreamError):
        parser.feed(lines)
    assert parse_all([b"data: " + b"y" * 99_000 + b"\n\n"]) == ([b"y" * 99_000], None)  # under the bound


# Payloads: printable JSON-ish text without line breaks (what engines send on one data line).
payloads = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=40).map(str.encode),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(
    events=payloads,
    crlf=st.booleans(),
    comments=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_split_of_a_valid_stream_parses_to_the_same_events(
    events: list[bytes], crlf: bool, comments: bool, cuts: list[int]
) -> None:
    end = b"\r\n" if crlf else b"\n"
    stream = b"".join((b": c" + end if comments else b"") + b"data: " + e + end + end for e in events)
    points = sorted({c % (len(stream) + 1) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    parsed, tail = parse_all(chunks)
    assert parsed == events
    assert tail is None


# -- SSE over loopback, through the one generation path ----------------------------------------------------


class _Raw:
    """A decoder that keeps each event's data as it came."""

    hint = AssemblyHint(family=EngineFamily.OPENAI)

    def decode(self, data: bytes) -> UpstreamEvent:
        return UpstreamEvent(data=data)


async def read_events(pool: UpstreamPool) -> list[bytes]:
    events: list[bytes] = []
    ended: asyncio.Future[UpstreamError | None] = asyncio.get_running_loop().create_future()

    def on_events(batch: list[UpstreamEvent]) -> bool:
        events.extend(event.data for event in batch)
        return True

    start_generation(
        pool,
        "/s",
        bytes,
        headers={},
        connect_s=10.0,
        decoder=_Raw(),
        on_events=on_events,
        on_end=ended.set_result,
    )
    error = await ended
    if error is not None:
        raise error
    return events


@pytest.mark.looptime  # the gaps between the writes are the fake loop's time: they cost nothing
@pytest.mark.parametrize("pieces", [1, 3, 17, 200])
@pytest.mark.parametrize("crlf", [False, True])
async def test_sse_reads_events_split_across_tcp_writes(fake: FakeEngine, pieces: int, crlf: bool) -> None:
    events = [orjson.dumps({"n": i, "text": "x" * i}) for i in range(12)]
    fake.on_sse(
        "POST", "/s", events, pieces=pieces, crlf=crlf, comments=True, gap_s=0.01 if pieces < 20 else 0
    )
    assert await read_events(UpstreamPool(fake.url)) == events


async def test_sse_requires_done(fake: FakeEngine) -> None:
    fake.on_sse("POST", "/s", [b"{}"], done=False)
    with pytest.raises(UpstreamError, match="before \\[DONE\\]") as caught:
        await read_events(UpstreamPool(fake.url))
    assert caught.value.retryable


async def test_sse_rejects_a_stream_cut_inside_an_event(fake: FakeEngine) -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"a":1}\n\ndata: {"b"')
        await response.write_eof()
        return response

    fake.on("POST", "/s", cut)
    with pytest.raises(UpstreamError, match="inside an event"):
        await read_events(UpstreamPool(fake.url))


async def test_sse_accepts_done_without_final_blank_line(fake: FakeEngine) -> None:
    async def terse(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b"data: {}\n\ndata: [DONE]\n", content_type="text/event-stream")

    fake.on("POST", "/s", terse)
    assert await read_events(UpstreamPool(fake.url)) == [b"{}"]


async def test_sse_reuses_the_connection_after_done(fake: FakeEngine) -> None:
    fake.on_sse("POST", "/s", [b"{}"])
    pool = UpstreamPool(fake.url)
    for _ in range(3):
        assert await read_events(pool) == [b"{}"]
        assert pool.idle_count == 1  # the one keep-alive connection went back to the pool
    pool.close()


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(400, False), (404, False), (422, False), (408, True), (429, True), (500, True), (503, True)],
)
def test_status_error_retryable_by_status(status: int, retryable: bool) -> None:
    error = status_error(status, b'{"object":"error","message":"bad thing","code":400}', what="POST x")
    assert error.retryable is retryable
    assert error.status == status
    assert "bad thing" in error.message
    assert error.body == b'{"object":"error","message":"bad thing","code":400}'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error":{"message":"nested"}}', "nested"),
        (b'{"detail":"Not Found"}', "Not Found"),
        (b"plain text failure", "plain text failure"),
        (b"", "(empty body)"),
    ],
)
def test_status_error_finds_the_message(body: bytes, message: str) -> None:
    assert message in status_error(500, body, what="x").message


@pytest.mark.parametrize(
    ("exception", "fragment"),
    [
        (aiohttp.ServerDisconnectedError(), "connection lost"),
        (aiohttp.ClientPayloadError("Response payload is not completed"), "connection lost"),
        (TimeoutError(), "timed out"),
        (ConnectionResetError("reset by peer"), "ConnectionResetError"),
        (aiohttp.ClientOSError(104, "reset"), "ClientOSError"),
        (orjson.JSONDecodeError("bad", "doc", 0), "unreadable"),
    ],
)
def test_map_exceptions_makes_network_errors_retryable(exception: BaseException, fragment: str) -> None:
    with pytest.raises(UpstreamError) as caught, map_exceptions("GET x"):
        raise exception
    assert caught.value.retryable
    assert fragment in caught.value.message
    assert caught.value.__cause__ is exception


def test_an_unparsable_answer_is_an_engine_fault_not_the_engines_400() -> None:
    """aiohttp reports a garbage status line as ClientResponseError(status=400): that 400 is aiohttp's, so the
    request is retried elsewhere rather than answered 400 as if the client were wrong."""
    garbage = aiohttp.http_exceptions.BadStatusLine(b"\xd8b\xc2")
    parsed = aiohttp.ClientResponseError(None, (), status=400, message=garbage.message)  # type: ignore[arg-type]
    parsed.__cause__ = garbage
    with pytest.raises(UpstreamError) as caught, map_exceptions("POST x"):
        raise parsed
    assert caught.value.retryable and caught.value.status is None
    assert "unreadable HTTP answer" in caught.value.message
    engines_own_400 = aiohttp.ClientResponseError(None, (), status=400, message="Bad Request")  # type: ignore[arg-type]
    with pytest.raises(UpstreamError) as caught, map_exceptions("POST x"):
        raise engines_own_400
    assert not caught.value.retryable and caught.value.status == 400


def test_map_exceptions_passes_upstream_errors_and_cancellation() -> None:
    original = UpstreamError("mine", retryable=False, status=400)
    with pytest.raises(UpstreamError) as caught, map_exceptions("x"):
        raise original
    assert caught.value is original
    with pytest.raises(asyncio.CancelledError), map_exceptions("x"):
        raise asyncio.CancelledError
    with pytest.raises(KeyError), map_exceptions("x"):
        raise KeyError("a bug is not an upstream error")


async def test_connection_refused_is_retryable(session: aiohttp.ClientSession) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UpstreamError, match="cannot connect") as caught, map_exceptions("GET"):
            async with session.get(f"http://127.0.0.1:{port}/", timeout=ControlTimeouts().control(5)):
                pass
    assert caught.value.retryable and caught.value.status is None


def test_error_frames() -> None:
    sglang = b'{"error":{"message":"Invalid","type":"invalid_request_error","code":400,"retryable":false}}'
    assert is_error_frame(sglang)
    assert not is_error_frame(b'{"id":"x","choices":[]}')
    with pytest.raises(UpstreamError) as caught:
        raise_for_error_frame(sglang)
    assert (caught.value.status, caught.value.retryable, caught.value.message) == (400, False, "Invalid")
    assert caught.value.body == sglang
    with pytest.raises(UpstreamError) as caught:
        raise_for_error_frame(b'{"error": {"message": "overloaded", "type": "server_error", "code": 503}}')
    assert (caught.value.status, caught.value.retryable) == (503, True)
    with pytest.raises(UpstreamError) as caught:
        raise_for_error_frame(b'{"error": "engine died"}')
    assert caught.value.retryable and caught.value.status is None
    with pytest.raises(UpstreamError, match="unreadable"):
        raise_for_error_frame(b'{"error": {')


def test_check_json_object() -> None:
    check_json_object(b'{"a":1}')
    check_json_object(b' {"a":1} ')
    for garbage in (b"<html>", b'{"cut', b"", b"[1,2]"):
        with pytest.raises(UpstreamError):
            check_json_object(garbage)


def test_parse_prometheus_sums_label_sets() -> None:
    text = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="q",tp_rank="0",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="q",tp_rank="0",dp_rank="1"} 4.0
sglang:num_queue_reqs{model_name="q"} 2
sglang:generation_tokens_total{model_name="q"} 1.5e3
sglang:other 9
broken_line{a="b"} notanumber
"""
    names = frozenset(
        {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:generation_tokens_total", "broken_line"}
    )
    assert parse_prometheus(text, names) == {
        "sglang:num_running_reqs": 7.0,
        "sglang:num_queue_reqs": 2.0,
        "sglang:generation_tokens_total": 1500.0,
    }


def test_control_timeouts_validate() -> None:
    with pytest.raises(ValueError, match="abort_s"):
        ControlTimeouts(abort_s=0)
    limits = ControlTimeouts(connect_s=2).control(5.0)
    assert limits.total == 5.0 and limits.sock_connect == 2 and limits.sock_read is None


async def test_sse_reply_helper_resets(fake: FakeEngine) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_reply(request, [b"{}", b"{}", b"{}"], reset_after=1)

    fake.on("POST", "/s", handler)
    with pytest.raises(UpstreamError, match="connection lost") as caught:
        await read_events(UpstreamPool(fake.url))
    assert caught.value.retryable
