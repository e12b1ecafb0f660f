"""The upstream connection's parsing (engines/upstream_wire.py, httptools): strict framing, fuzzed.

Most tests feed bytes to the protocol directly (a fake transport, any split of the byte stream, the close
when they say so); the strictness cases also go through a real loopback connection and `map_exceptions`, as
a generation does. The property tests compare what the connection makes of an answer with a strict reading
of RFC 9112 written here (`reference`), never with the code under test.
"""

from __future__ import annotations

import asyncio
import re
import string
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.http import map_exceptions
from rolloutgate.engines.upstream import UpstreamPool
from rolloutgate.engines.upstream_wire import (
    UpstreamConnection,
    UpstreamDisconnected,
    UpstreamProtocolError,
)

from .scripted import ScriptedServer

REQUEST = b"POST /generate HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class FakeTransport(asyncio.Transport):
    """What the connection calls on its transport; `close()` only marks it (the driver reports the close)."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        pass

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


@dataclass
class Outcome:
    status: int
    content_type: str
    body: bytes
    error: BaseException | None  # what reading the answer raised
    reusable: bool  # before the close: the answer ended and the connection could take the next request


async def drive(reads: Iterable[bytes], *, push: bool) -> Outcome:
    """Send a request on a fresh connection, feed it `reads` as the socket's reads, then the close; read the
    answer pulled (`send`, `readany`) or pushed (`start` armed with a sink)."""
    connection = UpstreamConnection()
    transport = FakeTransport()
    connection.connection_made(transport)
    pushed: list[bytes] = []

    def keep(piece: bytes) -> bool:
        pushed.append(piece)
        return True

    if push:
        head = connection.start(REQUEST, push_to=keep)
        reading = asyncio.ensure_future(_read(connection, head, head))
    else:
        reading = asyncio.ensure_future(_read(connection, connection.send(REQUEST), None))
    await asyncio.sleep(0)  # `send` is waiting for the head
    for data in reads:
        if transport.closing:
            break  # a closed transport reads no more
        connection.data_received(data)
    for _ in range(20):  # let the reader take what it can before the close
        await asyncio.sleep(0)
    reusable = connection.is_body_done and connection.is_reusable
    connection.connection_lost(None)
    try:
        async with asyncio.timeout(2):  # nothing here may wait: every byte and the close are in
            body = await reading
    except (UpstreamProtocolError, UpstreamDisconnected) as exc:
        return Outcome(connection.status, connection.content_type, b"", exc, False)
    return Outcome(connection.status, connection.content_type, b"".join(pushed) + body, None, reusable)


async def _read(
    connection: UpstreamConnection, head: Awaitable[object], push: asyncio.Future[None] | None
) -> bytes:
    """The body that was not pushed, once `head` (`send`, or the future of `start`) is done."""
    await head
    if push is not None and connection.is_push(push):
        return b""
    failure = connection.failure_before_status()
    if failure is not None:
        raise failure
    pieces = []
    while piece := await connection.readany():
        pieces.append(piece)
    return b"".join(pieces)


def run(reads: Iterable[bytes], *, push: bool) -> Outcome:
    return asyncio.run(drive(list(reads), push=push))


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [data[a:b] for a, b in pairwise(points)]


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


# -- the old parser's laxities ------------------------------------------------------------------------------

SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
# What the hand-written parser made of each (int() for sizes and lengths, a substring test for the coding):
LAX = {
    # chunk sizes, `int(line, 16)`: read as 16, 10 and 16 bytes
    "chunk-1_0": SSE + b"Transfer-Encoding: chunked\r\n\r\n1_0\r\n0123456789abcdef\r\n0\r\n\r\n",
    "chunk-+a": SSE + b"Transfer-Encoding: chunked\r\n\r\n+a\r\n0123456789\r\n0\r\n\r\n",
    "chunk-0x10": SSE + b"Transfer-Encoding: chunked\r\n\r\n0x10\r\n0123456789abcdef\r\n0\r\n\r\n",
    # Content-Length, `int(value)`: 10 and 5 bytes; `0x10` it refused too (base 10), now llhttp does
    "length-1_0": SSE + b"Content-Length: 1_0\r\n\r\n0123456789",
    "length-+5": SSE + b"Content-Length: +5\r\n\r\n01234",
    "length-0x10": SSE + b"Content-Length: 0x10\r\n\r\n0123456789abcdef",
    # Transfer-Encoding, `"chunked" in value`: both read as chunked (llhttp alone would read them to the
    # close, chunk lines and all: RFC 9112 6.3 for a response whose last coding is not chunked)
    "coding-notchunked": SSE + b"Transfer-Encoding: notchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "coding-chunked-gzip": SSE + b"Transfer-Encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("answer", LAX.values(), ids=LAX.keys())
@pytest.mark.parametrize("push", [False, True], ids=["pulled", "pushed"])
def test_what_the_old_parser_let_through_is_unreadable(answer: bytes, push: bool) -> None:
    for reads in ([answer], [answer[i : i + 1] for i in range(len(answer))]):
        outcome = run(reads, push=push)
        assert isinstance(outcome.error, UpstreamProtocolError), outcome
        assert str(outcome.error).startswith("unreadable HTTP answer: ")


@pytest.mark.parametrize("answer", LAX.values(), ids=LAX.keys())
async def test_the_old_laxities_surface_as_retryable_upstream_errors(
    server: ScriptedServer, answer: bytes
) -> None:
    server.script = lambda _request: [answer]
    pool = UpstreamPool(server.url)
    with pytest.raises(UpstreamError, match="unreadable HTTP answer") as caught, map_exceptions("POST"):
        async with pool.post("/generate", b"{}", {}) as response:
            await response.read()
    assert caught.value.retryable and pool.idle_count == 0
    pool.close()


# -- what the connection decides on its own ----------------------------------------------------------------

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@pytest.mark.parametrize(
    ("reads", "status", "body", "reusable"),
    [
        ([OK], 200, b"ok", True),
        ([OK + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno"], 200, b"ok", False),  # an extra answer
        ([OK + b"zz"], 200, b"ok", False),  # bytes after the answer
        ([OK, b"zz"], 200, b"ok", False),  # ... in a read of their own
        ([b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"], 200, b"ok", False),
        ([b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"], 200, b"ok", False),
        ([b"HTTP/1.1 200 OK\r\n\r\nto the close"], 200, b"to the close", False),
        ([b"HTTP/1.1 100 Continue\r\nX: 1\r\n\r\n" + OK], 200, b"ok", True),
        ([b"HTTP/1.1 204 No Content\r\n\r\n"], 204, b"", True),
        (
            [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nContent-Type: x/y\r\n\r\n"],
            200,
            b"ok",
            True,
        ),
    ],
    ids=["length", "two-answers", "garbage-after", "garbage-later", "http-1.0", "close", "to-eof", "interim",
         "no-content", "trailers"],
)  # fmt: skip
def test_framing_and_reuse(reads: list[bytes], status: int, body: bytes, reusable: bool) -> None:
    outcome = run(reads, push=False)
    assert (outcome.error, outcome.status, outcome.body, outcome.reusable) == (None, status, body, reusable)
    assert outcome.content_type == ""  # a trailer is not a header


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "Expected HTTP/"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nzz", "gzip-encoded"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "only chunked"),
        (b"HTTP/1.1 099 Early\r\nContent-Length: 0\r\n\r\n", "status 99"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n", "upgrade"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "Duplicate"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", "CR"),
        (b"HTTP/1.1 200 OK\r\nX-Long: " + b"x" * 70_000, "too long"),
        (b"HTTP/1.1 200 \x00K\r\nContent-Length: 2\r\n\r\nok", "reason phrase"),
    ],
    ids=["not-http", "content-coding", "transfer-coding", "status", "upgrade", "two-lengths",
         "length-and-chunked", "bare-lf", "long-head", "control-byte-in-reason"],
)  # fmt: skip
def test_an_unreadable_answer_is_refused(answer: bytes, message: str) -> None:
    outcome = run([answer[i : i + 4096] for i in range(0, len(answer), 4096)], push=False)
    assert isinstance(outcome.error, UpstreamProtocolError)
    assert message in str(outcome.error)


def test_a_cut_answer_is_a_disconnection() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert str(run([head[:10]], push=False).error) == "Server disconnected"
    assert str(run([head + b"5\r\nhel"], push=False).error) == "Response payload is not completed"
    assert str(run([head + b"5\r\nhel"], push=True).error) == "Response payload is not completed"


def test_an_empty_event_stream_in_the_read_of_its_head_is_not_pushed() -> None:
    async def scenario() -> tuple[bool, bool]:
        connection = UpstreamConnection()
        connection.connection_made(FakeTransport())
        done = connection.start(REQUEST, push_to=lambda piece: True)
        connection.data_received(SSE + b"Content-Length: 0\r\n\r\n")
        await done
        return connection.is_push(done), connection.is_body_done

    assert asyncio.run(scenario()) == (False, True)


def test_a_pulled_body_pauses_reading_above_the_high_water_mark() -> None:
    async def scenario() -> list[bool]:
        connection = UpstreamConnection()
        transport = FakeTransport()
        connection.connection_made(transport)
        sending = asyncio.ensure_future(connection.send(REQUEST))
        await asyncio.sleep(0)
        connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 400000\r\n\r\n")
        await sending
        seen = []
        for _ in range(2):
            connection.data_received(b"x" * 200_000)
            seen.append(transport.paused)
        assert len(await connection.readany()) == 400_000
        return [*seen, transport.paused, connection.is_body_done]

    assert asyncio.run(scenario()) == [False, True, False, True]


# -- the property tests ------------------------------------------------------------------------------------

_HEX = re.compile(rb"[0-9A-Fa-f]+")
_STATUS_LINE = re.compile(
    rb"HTTP/1\.[01] ([0-9]{3})(?: [\t -~\x80-\xff]*)?"
)  # reason: HTAB SP VCHAR obs-text
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*([\t -~\x80-\xff]*?)[ \t]*")  # obs-text too


def reference(answer: bytes) -> tuple[int, bytes] | None:
    """(status, body) of `answer` read strictly by RFC 9112 (responses to a POST; what follows the answer is
    not read); None for an answer that is invalid or not complete, or that asks for a coding."""
    rest = answer
    while True:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status_line = _STATUS_LINE.fullmatch(lines[0])
        fields = [_FIELD.fullmatch(line) for line in lines[1:]]
        if not sep or status_line is None or None in fields:
            return None
        status = int(status_line[1])
        if not 100 <= status < 200:
            break
    headers = [(field[1].lower(), field[2].lower()) for field in fields if field is not None]
    if status < 100 or any(n == b"content-encoding" and v not in (b"", b"identity") for n, v in headers):
        return None
    if status in (204, 304):
        return status, b""
    codings = [value for name, value in headers if name == b"transfer-encoding"]
    lengths = [value for name, value in headers if name == b"content-length"]
    if codings:
        return None if lengths or codings != [b"chunked"] else _dechunk(status, rest)
    if lengths:
        if len(lengths) != 1 or not lengths[0].isdigit() or len(rest) < int(lengths[0]):
            return None
        return status, rest[: int(lengths[0])]
    return status, rest  # to the close


def _dechunk(status: int, rest: bytes) -> tuple[int, bytes] | None:
    body = bytearray()
    pos = 0
    while True:
        end = rest.find(b"\r\n", pos)
        size = rest[pos:end].partition(b";")[0]  # extensions are not read: their syntax changes no length
        if end < 0 or not _HEX.fullmatch(size):
            return None
        pos = end + 2
        if int(size, 16) == 0:
            break
        data_end = pos + int(size, 16)
        if rest[data_end : data_end + 2] != b"\r\n":
            return None
        body += rest[pos:data_end]
        pos = data_end + 2
    while (end := rest.find(b"\r\n", pos)) > pos:  # trailer fields, up to the blank line
        pos = end + 2
    return (status, bytes(body)) if end == pos else None


_TOKEN = st.text(string.ascii_letters + string.digits + "-", min_size=1, max_size=10).filter(
    lambda name: (
        name.lower()
        not in ("content-type", "content-length", "transfer-encoding", "content-encoding", "connection")
    )
)
_VALUE = st.text(string.ascii_letters + string.digits + " ;=/,.-", max_size=16).map(str.strip)


@st.composite
def answers(draw: st.DrawFn) -> tuple[bytes, int, str, bytes, bool]:
    """A well-formed answer: (bytes, status, media type, body, whether the connection is reusable after it)."""
    status = draw(st.integers(200, 599).filter(lambda s: s not in (204, 304)))
    version = draw(st.sampled_from([b"1.1", b"1.1", b"1.0"]))
    framing = draw(
        st.sampled_from(["chunked", "length", "close"] if version == b"1.1" else ["length", "close"])
    )
    close = draw(st.booleans()) if framing != "close" else False
    media_type = draw(st.sampled_from(["text/event-stream", "application/json", ""]))
    body = draw(st.binary(max_size=400))
    head = [b"HTTP/%s %d %s" % (version, status, draw(st.sampled_from([b"OK", b"", b"Some Reason"])))]
    fields = [
        (name.encode(), value.encode())
        for name, value in draw(st.lists(st.tuples(_TOKEN, _VALUE), max_size=4))
    ]
    if media_type:
        fields.append(
            (b"Content-Type", media_type.encode() + draw(st.sampled_from([b"", b"; charset=utf-8"])))
        )
    if close:
        fields.append((b"Connection", b"close"))
    if framing == "chunked":
        fields.append((draw(st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"])), b"chunked"))
        sizes = draw(st.lists(st.integers(1, 64), max_size=12))
        pieces, pos = [], 0
        for size in sizes:
            if pos < len(body):
                pieces.append(body[pos : pos + size])
                pos += size
        if pos < len(body):
            pieces.append(body[pos:])
        upper = draw(st.booleans())
        framed = b"".join(
            b"%s%s\r\n%s\r\n"
            % ((b"%X" if upper else b"%x") % len(p), draw(st.sampled_from([b"", b";ext=1"])), p)
            for p in pieces
        )
        trailers = draw(st.sampled_from([b"", b"X-Trailer: t\r\n"]))
        payload = framed + b"0\r\n" + trailers + b"\r\n"
    elif framing == "length":
        fields.append((b"Content-Length", b"%d" % len(body)))
        payload = body
    else:
        payload = body
    fields = draw(st.permutations(fields))
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    raw = (
        interim
        + b"\r\n".join(head + [name + b": " + value for name, value in fields])
        + b"\r\n\r\n"
        + payload
    )
    reusable = version == b"1.1" and framing != "close" and not close
    return raw, status, media_type, body, reusable


@FUZZ
@given(answer=answers(), cuts=st.lists(st.integers(0, 10_000), max_size=12), push=st.booleans())
def test_any_well_formed_answer_reads_as_itself_in_any_split(
    answer: tuple[bytes, int, str, bytes, bool], cuts: list[int], push: bool
) -> None:
    raw, status, media_type, body, reusable = answer
    outcome = run(split(raw, cuts), push=push)
    assert outcome.error is None, outcome
    assert (outcome.status, outcome.content_type, outcome.body) == (status, media_type, body)
    assert outcome.reusable == reusable
    assert reference(raw) == (status, body)  # the reference agrees (else the mutation test means little)


_SIZE_ALPHABET = '0123456789abcdefABCDEFxX_+- \t;="\r\n'


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """(a well-formed answer, the same with its framing or bytes mutated, or garbage)."""
    body = draw(st.binary(min_size=1, max_size=120))
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if draw(st.booleans()):
        cut = draw(st.integers(1, len(body)))
        pieces = [body[:cut], body[cut:]] if cut < len(body) else [body]
        original = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*pieces)
        kind = draw(st.sampled_from(["size", "coding", "bytes", "cut", "garbage"]))
        if kind == "size":
            sizes = [b"%x" % len(piece) for piece in pieces] + [b"0"]  # the last: the terminator's
            sizes[draw(st.integers(0, len(pieces)))] = draw(st.text(_SIZE_ALPHABET, max_size=6)).encode()
            frames = b"".join(
                b"%s\r\n%s\r\n" % (size, piece) for size, piece in zip(sizes, pieces, strict=False)
            )
            return original, head + b"Transfer-Encoding: chunked\r\n\r\n" + frames + sizes[-1] + b"\r\n\r\n"
        if kind == "coding":
            coding = draw(
                st.sampled_from([b"chunked, gzip", b"notchunked", b"gzip", b"chunked, chunked", b"identity"])
                | st.text(string.ascii_letters + ", \t", max_size=12).map(str.encode)
            )
            return original, original.replace(b"Transfer-Encoding: chunked", b"Transfer-Encoding: " + coding)
    else:
        original = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        kind = draw(st.sampled_from(["length", "bytes", "cut", "garbage"]))
        if kind == "length":
            value = draw(st.text("0123456789abcdefxX_+- \t,", max_size=6)).encode()
            return original, original.replace(b"Content-Length: %d" % len(body), b"Content-Length: " + value)
    if kind == "bytes":
        answer = bytearray(original)
        for _ in range(draw(st.integers(1, 3))):
            pos = draw(st.integers(0, len(answer) - 1))
            byte = draw(st.sampled_from(b"\r\n :;0aA\x00\x7f\xff" + bytes([answer[pos] ^ 0x20])))
            how = draw(st.sampled_from(["set", "insert", "delete"]))
            if how == "set":
                answer[pos] = byte
            elif how == "insert":
                answer.insert(pos, byte)
            else:
                del answer[pos]
        return original, bytes(answer)
    if kind == "cut":
        return original, original[: draw(st.integers(0, len(original) - 1))]
    return original, draw(st.binary(max_size=200))


@FUZZ
@given(case=mutated(), cuts=st.lists(st.integers(0, 10_000), max_size=8), push=st.booleans())
def test_a_mutated_answer_is_refused_or_read_as_the_rfc_reads_it(
    case: tuple[bytes, bytes], cuts: list[int], push: bool
) -> None:
    """Only the upstream error types, no wait past the close, and a body only as a strict reading gives it
    (or, where the reference cannot read the answer, as the answer before the mutation had it)."""
    original, answer = case
    outcome = run(split(answer, cuts), push=push)
    if outcome.error is not None:
        return  # refused (the types are `drive`'s: any other exception fails the test)
    expected = reference(answer) or reference(original)
    assert expected is not None and (outcome.status, outcome.body) == expected, (answer, outcome)
