"""Each HTTP attempt of the agents' client, as the client made it, and the gateway request it became.

Theory of operation: a turn is one LiteLLM call, and LiteLLM (the OpenAI SDK inside it) makes up to three HTTP
attempts of it, out of the agent's sight. They are recorded where they happen, in the client: LiteLLM's async
HTTP client is its documented `litellm.aclient_session`, set once per process (`install`) to an
`httpx.AsyncClient` over LiteLLM's own transport wrapped in `AttemptTap`. While an agent's call runs, a context
variable names its turn (`recording`); the tap records each attempt made in that context: when it was sent,
its status, when its answer was read to the end, or that the client gave up first (`client_gone`: its read
timeout, or the end of the run). Calls outside a turn (the warm-up) pass through unrecorded.

The gateway request each attempt became (`join`): a driver observer sees every arrival with its routing key,
the agent's session (gateway.py). A session's attempts follow one another (its turns are sequential, and so
are LiteLLM's retries), so an arrival belongs to the last attempt of its session sent before it. An attempt
that made no new request (a retry attached to its earlier one, server/attach.py) keeps the id its answer
names (`X-Rolloutgate-Request-Id`), when it got one.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ("AttemptRecord", "AttemptTap", "install", "join", "recording")


@dataclass(slots=True)
class AttemptRecord:
    """One client HTTP attempt (simulated seconds)."""

    tag: str  # the turn's
    routing_key: str  # the session's: what the gateway sees as the request's routing key
    retry_count: int  # LiteLLM's (the OpenAI SDK's `x-stainless-retry-count`)
    arrived_at: float  # sent
    path: str
    request_id: str | None = None  # the gateway request it became
    ended_at: float | None = None
    status: int | None = None
    client_gone: bool = False  # the client gave up before the whole answer arrived


@dataclass(frozen=True, slots=True)
class _Turn:
    tag: str
    routing_key: str
    now: Callable[[], float]
    attempts: list[AttemptRecord]


_TURN: contextvars.ContextVar[_Turn | None] = contextvars.ContextVar("replay_turn", default=None)


@contextlib.contextmanager
def recording(
    tag: str, routing_key: str, now: Callable[[], float], attempts: list[AttemptRecord]
) -> Iterator[None]:
    """Within: the attempts of this turn's call are appended to `attempts`."""
    token = _TURN.set(_Turn(tag, routing_key, now, attempts))
    try:
        yield
    finally:
        _TURN.reset(token)


def _end(record: AttemptRecord, now: Callable[[], float], *, gone: bool) -> None:
    if record.ended_at is None:
        record.ended_at = now()
        record.client_gone = gone


class _Body(httpx.AsyncByteStream):
    """An answer's body on its way to the client: its end is the attempt's end."""

    def __init__(self, inner: httpx.AsyncByteStream, record: AttemptRecord, now: Callable[[], float]) -> None:
        self._inner, self._record, self._now = inner, record, now

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except BaseException:  # a read timeout, a cancellation, the reader stopping early
            _end(self._record, self._now, gone=True)
            raise
        _end(self._record, self._now, gone=False)

    async def aclose(self) -> None:
        _end(self._record, self._now, gone=True)  # closed before its end was read: the client gave up
        await self._inner.aclose()


class AttemptTap(httpx.AsyncBaseTransport):
    """`inner` with every attempt made within `recording` recorded (module docstring)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        turn = _TURN.get()
        if turn is None:
            return await self._inner.handle_async_request(request)
        retries = request.headers.get("x-stainless-retry-count", "0")
        record = AttemptRecord(
            tag=turn.tag,
            routing_key=turn.routing_key,
            retry_count=int(retries) if retries.isdigit() else -1,
            arrived_at=turn.now(),
            path=request.url.path,
        )
        turn.attempts.append(record)
        try:
            response = await self._inner.handle_async_request(request)
        except BaseException:
            _end(record, turn.now, gone=True)
            raise
        record.status = response.status_code
        record.request_id = response.headers.get("X-Rolloutgate-Request-Id")
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_Body(response.stream, record, turn.now),
            extensions=response.extensions,
            request=request,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


_client: httpx.AsyncClient | None = None  # the tapped client of this process


def install(litellm: Any) -> None:
    """LiteLLM's async HTTP client, tapped: its own transport (aiohttp by default) behind `AttemptTap`, made once
    per process; no proxy from the environment (every call goes to the gateway on loopback)."""
    global _client
    if _client is None:
        from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

        inner = AsyncHTTPHandler.create_async_transport() or httpx.AsyncHTTPTransport()
        _client = httpx.AsyncClient(transport=AttemptTap(inner), follow_redirects=True, trust_env=False)
    litellm.aclient_session = _client


def join(attempts: Iterable[AttemptRecord], arrivals: Iterable[tuple[float, str, str | None]]) -> None:
    """Give each attempt the gateway request it became (module docstring); `arrivals`: (at, request id,
    routing key) of every request the gateway received."""
    by_key: dict[str, list[AttemptRecord]] = {}
    for attempt in sorted(attempts, key=lambda a: a.arrived_at):
        by_key.setdefault(attempt.routing_key, []).append(attempt)
    sent = {key: [a.arrived_at for a in mine] for key, mine in by_key.items()}
    for at, request_id, key in arrivals:
        index = bisect.bisect_right(sent.get(key or "", []), at) - 1
        if index >= 0:
            by_key[key or ""][index].request_id = request_id
