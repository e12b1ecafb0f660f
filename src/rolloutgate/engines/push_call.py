"""`start_generation`: the one call every adapter makes to run a generation; and the call without a task.

Theory of operation: a generation runs one of two ways, the same to the adapter and the driver. When the
engine's pool has an idle keep-alive connection, `start_push_generation` needs no task: it writes the request
on that connection with the push armed (upstream_wire.py `start`), the answer's reads go to the sink as they
arrive, and one future callback ends the call when the push settles. Otherwise a task connects, sends and
pushes (`run_to_end`, engines/generation.py `push_generation`). Why two: a task, its first step, its wake-up and the four
coroutine frames it resumes were ~5% of the gateway's CPU per request at 32 connections on short calls
(docs/benchmarks.md); on the RL shape (answers of thousands of tokens) neither costs anything that shows.

The outcome goes to `on_end` exactly once (never after `cancel()`), from a loop callback of its own (never
inside the socket read that settled the push, so the driver may reuse the connection at once):

- the stream reached `[DONE]`: `on_end(None)`; the connection goes back to its pool once its answer ended
  (the chunked terminator usually comes in the same read; otherwise it is drained, for at most
  `DRAIN_AFTER_DONE_S`);
- the sink stopped it (its exchange ended, or a newer attempt runs): the connection is closed, `on_end(None)`
  (the driver ignores what a stale attempt reports);
- a failure (connection lost, an error event, an unreadable answer, a stream that ended before `[DONE]`):
  `on_end(UpstreamError)`, the connection closed;
- headers that start no push (an error status, a whole JSON answer): the rest of the answer is read as
  `push_generation` reads it, in a task (`finish_answer`), then `on_end`.

`cancel()` (a retry elsewhere, a verdict, shutdown) closes the connection: how an engine learns its client
left, as when the task of `push_generation` is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.generation import (
    EndSink,
    EventDecoder,
    EventSink,
    SsePush,
    UpstreamHandle,
    finish_answer,
    push_generation,
)
from rolloutgate.engines.http import (
    DRAIN_AFTER_DONE_S,
    as_upstream_error,
    generation_headers,
    map_exceptions,
)
from rolloutgate.engines.upstream import UpstreamAnswer, UpstreamPool
from rolloutgate.engines.upstream_wire import UpstreamConnection

__all__ = ("PushedGeneration", "start_generation", "start_push_generation")


def start_generation(
    pool: UpstreamPool,
    path: str,
    make_body: Callable[[], bytes],
    *,
    headers: Mapping[str, str],
    connect_s: float,
    decoder: EventDecoder,
    on_events: EventSink,
    on_end: EndSink,
) -> UpstreamHandle:
    """Run one generation (module docstring): POST `make_body()` to `path` on the engine's pool, its events
    to `on_events`, its outcome to `on_end`. Returns the handle of the running call."""
    pushed = start_push_generation(
        pool, path, make_body, headers=headers, decoder=decoder, on_events=on_events, on_end=on_end
    )
    if pushed is not None:
        return pushed
    return asyncio.get_running_loop().create_task(
        run_to_end(pool, path, make_body, headers, connect_s, decoder, on_events, on_end)
    )


async def run_to_end(
    pool: UpstreamPool,
    path: str,
    make_body: Callable[[], bytes],
    headers: Mapping[str, str],
    connect_s: float,
    decoder: EventDecoder,
    on_events: EventSink,
    on_end: EndSink,
) -> None:
    try:
        # the body is built here and held by push_generation alone, which lets it go once it is sent
        await push_generation(
            pool,
            path,
            make_body(),
            headers=headers,
            connect_s=connect_s,
            decoder=decoder,
            on_events=on_events,
        )
    except UpstreamError as error:
        on_end(error)
    else:
        on_end(None)


def start_push_generation(
    pool: UpstreamPool,
    path: str,
    make_body: Callable[[], bytes],
    *,
    headers: Mapping[str, str],
    decoder: EventDecoder,
    on_events: EventSink,
    on_end: EndSink,
) -> PushedGeneration | None:
    """Start the call on an idle connection of `pool`; None when there is none (then a task runs it).
    `make_body` is called only when the call starts here."""
    connection = pool.take_idle()
    if connection is None:
        return None
    try:
        request = pool.request_bytes(path, make_body(), generation_headers(headers))
    except ValueError:
        pool.finish(connection, ok=False)  # nothing was sent; the task path raises the same error
        return None
    return PushedGeneration(
        pool, connection, request, f"POST {pool.base_url}{path}", decoder, on_events, on_end
    )


class PushedGeneration:
    """The handle of one call started by `start_push_generation` (module docstring): `cancel()`, `done()`."""

    __slots__ = ("_connection", "_decoder", "_on_end", "_on_events", "_pool", "_rest", "_sink", "_what")

    def __init__(
        self,
        pool: UpstreamPool,
        connection: UpstreamConnection,
        request: bytes,
        what: str,
        decoder: EventDecoder,
        on_events: EventSink,
        on_end: EndSink,
    ) -> None:
        self._pool = pool
        self._connection: UpstreamConnection | None = connection  # None once the call no longer holds it
        self._what = what
        # What the answer goes to, dropped once the outcome is reported (or the call cancelled): it leads
        # back to the exchange, which holds this handle, and a cycle would wait for the cyclic collector.
        self._decoder: EventDecoder | None = decoder
        self._on_events: EventSink | None = on_events
        self._on_end: EndSink | None = on_end  # None once reported or cancelled
        self._rest: asyncio.Task[None] | None = None  # reading an answer that started no push
        self._sink: SsePush | None = SsePush(decoder, on_events)
        connection.start(request, push_to=self._sink).add_done_callback(self._settled)

    def done(self) -> bool:
        return self._on_end is None

    def cancel(self) -> bool:
        self._drop_consumer()
        if self._rest is not None:
            self._rest.cancel()  # its connection closes as it unwinds
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.stop_push()
            connection.close()
        return True

    # -- the callbacks -------------------------------------------------------------------------------------

    def _settled(self, future: asyncio.Future[None]) -> None:
        connection = self._connection
        if connection is None or self._on_end is None:
            return  # cancelled
        if not connection.is_push(future):
            failure = connection.failure_before_status()
            if failure is not None:
                self._end(_as_upstream_error(self._what, failure), close=True)
            else:  # headers that start no push: read the rest in a task, as push_generation does
                self._rest = asyncio.get_running_loop().create_task(self._finish(connection))
            return
        connection.stop_push()
        failed = future.exception()
        if failed is not None:
            self._end(_as_upstream_error(self._what, failed), close=True)
            return
        sink = self._sink
        assert sink is not None  # dropped only with `_on_end`
        if not sink.saw_done:
            self._end(None if sink.stopped else sink.end_error(), close=True)
            return
        if connection.is_body_done:
            self._end(None, close=False)
            return
        # The chunked terminator is still to come: the answer is complete, the connection is reused once
        # it is drained (within `DRAIN_AFTER_DONE_S`, else closed).
        self._report(None)
        drained = connection.start_push(_discard)
        timer = asyncio.get_running_loop().call_later(DRAIN_AFTER_DONE_S, connection.close)
        drained.add_done_callback(lambda future: self._drained(future, timer))

    def _drained(self, future: asyncio.Future[None], timer: asyncio.TimerHandle) -> None:
        timer.cancel()
        self._release(ok=future.exception() is None)

    async def _finish(self, connection: UpstreamConnection) -> None:
        answer = UpstreamAnswer(connection)
        sink, decoder, on_events = self._sink, self._decoder, self._on_events
        assert sink is not None and decoder is not None and on_events is not None  # not reported yet
        try:
            with map_exceptions(self._what):
                await finish_answer(answer, self._what, sink, decoder, on_events)
        except UpstreamError as error:
            self._end(error, close=True)
            return
        except BaseException:  # cancelled (`cancel()` closed the connection already), or a bug
            self._release(ok=False)
            raise
        self._end(None, close=False)

    def _end(self, error: UpstreamError | None, *, close: bool) -> None:
        self._release(ok=not close)
        self._report(error)

    def _release(self, *, ok: bool) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.stop_push()
            self._pool.finish(connection, ok=ok)

    def _report(self, error: UpstreamError | None) -> None:
        on_end = self._on_end
        self._drop_consumer()
        if on_end is not None:
            on_end(error)

    def _drop_consumer(self) -> None:
        self._on_end = self._on_events = self._decoder = self._sink = None


def _discard(piece: bytes) -> bool:
    return True


def _as_upstream_error(what: str, failed: BaseException) -> UpstreamError:
    """What the push's future failed with, as `map_exceptions` would raise it; anything else (a bug, not an
    answer of the engine's) is raised, as it would escape the task of `push_generation`."""
    if isinstance(failed, Exception):
        error = as_upstream_error(what, failed)
        if error is not None:
            return error
    raise failed
