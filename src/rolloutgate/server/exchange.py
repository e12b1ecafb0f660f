"""One client request at the edge: what its handlers are waiting for, and what its upstream attempts produced.

Theory of operation: the front handler creates an `Exchange`, submits it to the driver, subscribes and then only
reads its queue. The driver's upstream task publishes what clients must see: stream events (streaming
clients), then exactly one terminal item, `Finished` (the answer, or the end of the stream) or a
`GatewayError`. The handler decides how to write them (headers now or later, keep-alive, error framing).

A retry that attaches (server/attach.py) is one more subscriber: it first receives the stream events already
published (kept only for exchanges that can be attached to), then follows live. When the last subscriber
leaves, the client is gone (the driver starts the retry grace period).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.engines.base import AssemblyHint, Route, UpstreamError, UpstreamHandle
from rolloutgate.engines.progress import has_index, index_of
from rolloutgate.errors import GatewayError, Unavailable
from rolloutgate.server.assemble import ResponseAssembler
from rolloutgate.server.continuation import GenerateStitcher
from rolloutgate.server.deadlines import deadlines_of

__all__ = ("DEFAULT_CLIENT_BUFFER_BYTES", "Exchange", "Finished", "Outbox", "OutboxItem")

DEFAULT_CLIENT_BUFFER_BYTES = 4 * 1024 * 1024


@dataclass(slots=True)  # not frozen: built per request (core/events.py, `_per_request`)
class Finished:
    """The request completed. `body` is the assembled answer for a non-streaming client (None for a stream)."""

    timing: TimingBreakdown
    body: bytes | None = None
    engine_url: str | None = None


OutboxItem = bytes | Finished | GatewayError  # bytes: one stream event's JSON data, forwarded as SSE


class Outbox:
    """One subscriber's queue; counts the stream bytes waiting in it (how far its client is behind).

    The part of `asyncio.Queue`'s API the edge uses (`put_nowait`, `get`, `get_nowait`, `empty`), for
    one reader, at a fraction of its cost: a list and, while the reader waits, one future (an asyncio.Queue
    holds three deques and an Event, ~3 KB per subscriber, and costs several times more per item; measured in
    docs/benchmarks.md). `get(timeout_s)` raises TimeoutError when nothing came for that long (its deadline is
    an entry of the loop's shared `WaitDeadlines`, not a loop timer of its own).

    A stream event wakes the waiting reader one loop step later (a terminal item wakes it at once): what the
    same read of the engine's socket completes, more events and often the end of the answer (the upstream
    task finishes in that step), is then in the outbox when the reader runs, and goes out in one write.
    """

    __slots__ = ("_head", "_items", "_waiter", "_waking", "buffered_bytes", "limit_bytes")

    def __init__(self) -> None:
        self._items: list[OutboxItem] = []
        self._head = 0  # items before it were taken
        self._waiter: asyncio.Future[bool] | None = None  # True: woken by the timeout
        self._waking = False  # a wake-up of the reader is scheduled (`_wake`)
        self.buffered_bytes = 0
        self.limit_bytes = DEFAULT_CLIENT_BUFFER_BYTES

    def empty(self) -> bool:
        return self._head == len(self._items)

    def put_nowait(self, item: OutboxItem) -> None:
        self._items.append(item)
        if not isinstance(item, bytes):
            self._wake()
            return
        self.buffered_bytes += len(item)
        if self._waiter is not None and not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._wake)

    def put_events(self, events: list[bytes]) -> None:
        """`put_nowait` of each stream event, with one wake-up."""
        self._items.extend(events)
        for data in events:
            self.buffered_bytes += len(data)
        if self._waiter is not None and not self._waking:
            self._waking = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _wake(self) -> None:
        self._waking = False
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def get_nowait(self) -> OutboxItem:
        """The oldest item. Raises asyncio.QueueEmpty when there is none."""
        items = self._items
        head = self._head
        if head == len(items):
            raise asyncio.QueueEmpty
        item = items[head]
        head += 1
        if head == len(items):
            items.clear()
            head = 0
        elif head >= 64 and head * 2 >= len(items):
            del items[:head]  # a reader that never catches up: drop the taken slots now and then
            head = 0
        self._head = head
        if isinstance(item, bytes):
            self.buffered_bytes -= len(item)
        return item

    async def get(self, timeout_s: float | None = None) -> OutboxItem:
        """The oldest item, waiting for one (at most `timeout_s`, then TimeoutError)."""
        while self._head == len(self._items):
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            if timeout_s is None:
                try:
                    timed_out = await waiter
                finally:
                    self._waiter = None
            else:
                deadlines = deadlines_of(loop)  # one loop timer for every waiting reader (deadlines.py)
                deadlines.add(timeout_s, waiter)
                try:
                    timed_out = await waiter
                finally:
                    self._waiter = None
                    deadlines.settled()
            if timed_out and self._head == len(self._items):
                raise TimeoutError
        return self.get_nowait()


def _too_slow(limit_bytes: int) -> GatewayError:
    return Unavailable(
        f"the client read the stream too slowly: it fell more than {limit_bytes} bytes behind the engine "
        "(client_buffer_bytes)",
        code="client_too_slow",
    )


@dataclass(eq=False, slots=True)
class Exchange:
    request_id: str
    route: Route
    body: dict[str, Any]
    client_streams: bool
    forward_headers: dict[str, str] = field(default_factory=dict)
    wants_usage: bool = False  # a streaming client asked for the usage frame (stream_options.include_usage)
    attach_key: str | None = None  # retries with this key join this exchange
    subscribers: list[Outbox] = field(default_factory=list)
    max_buffered_bytes: int = DEFAULT_CLIENT_BUFFER_BYTES  # a subscriber further behind is cut off
    history: list[bytes] | None = None  # published stream events (streaming clients): replay and continuation
    stitcher: GenerateStitcher | None = None  # a continued /generate stream's chunk rewriter
    # how the engine's /generate chunks add up, once one said they are not cumulative (SGLang's default
    # streaming mode, where each repeats all earlier output): incremental, or incremental in their ids alone
    stream_shape: AssemblyHint | None = None
    committed: bool = False  # a client already received a 200 (keep-alive): errors must be framed in-body
    # upstream state, owned by the driver
    attempt: int = 0
    engine_id: str | None = None
    engine_url: str | None = None
    upstream_task: UpstreamHandle | None = (
        None  # the running call: a task, or callbacks (engines/push_call.py)
    )
    winding_down: int = 0  # an aborted attempt read to the engine's end of it, its events dropped (driver)
    assembler: ResponseAssembler | None = None  # this attempt's answer so far (non-streaming clients)
    delivered_tokens: int = 0  # tokens a streaming client has already been sent
    upstream_error: UpstreamError | None = None  # the engine's own non-retryable error, passed through
    # an abort the gateway asked the engine for (a client's or a trainer's /abort_request through it, a stale
    # generation's partial answer): the engine's abort answer is then the answer, never re-run
    abort_ordered: bool = False
    # with `engine_pause_aborts = rerun`: the attempt whose events said finish reason abort unasked, and what a
    # streaming client is not sent of it until the engine says whether its own pause did it
    engine_abort_attempt: int = 0
    held: list[bytes] | None = None
    ended: bool = False
    on_abandoned: Callable[[Exchange], None] | None = None  # the last reader was cut off (set by the driver)

    @property
    def client_rid(self) -> str | None:
        """The client's own `rid` (SGLang bodies), which leads the id its calls carry upstream."""
        rid = self.body.get("rid")
        return rid if isinstance(rid, str) and rid else None

    def subscribe(self) -> Outbox:
        """A queue of everything this exchange publishes from now on (stream history first, if kept)."""
        queue = Outbox()
        for data in self.history or ():
            queue.put_nowait(data)
        # The history is shared (no copy), so only what comes after it counts against the limit.
        queue.limit_bytes = self.max_buffered_bytes + queue.buffered_bytes
        self.subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: Outbox) -> bool:
        """Remove a subscriber; True if none is left (the client side is gone)."""
        if queue in self.subscribers:
            self.subscribers.remove(queue)
        return not self.subscribers

    def has_ended(self) -> bool:
        """`ended`, read afresh: for a check after a call that may have ended the exchange. mypy keeps an
        attribute narrowed across calls, so a second `if exchange.ended:` would look unreachable to it (and
        mypyc compiles an unreachable block into a RuntimeError)."""
        return self.ended

    def finish(self, item: Finished | GatewayError) -> None:
        if not self.ended:
            self.ended = True
            for queue in self.subscribers:
                queue.put_nowait(item)

    def release_request(self) -> None:
        """The exchange ended: drop what only its upstream attempts read (the parsed request body, the
        assembler, the continuation state). A finished exchange can stay in the attach cache for
        `result_ttl` (server/attach.py), and a parsed 100K-token prompt is megabytes of Python ints; a
        replay needs only the history and the terminal item."""
        self.body = {}
        self.assembler = None
        self.stitcher = None
        self.upstream_error = None

    def send_events(self, events: list[bytes]) -> None:
        """Publish stream events (the events of one upstream read, in order) to every subscriber.

        A subscriber that is then too far behind is coalesced (cumulative /generate) or cut off, once per
        read: it may pass its limit by one read's worth first."""
        if self.ended:
            return
        is_cumulative = self.route is Route.GENERATE and self.stream_shape is None
        history = self.history
        if history is not None:
            if is_cumulative:
                for data in events:
                    self._remember_latest(history, data)
            else:
                history.extend(events)
        lagging = None
        for queue in self.subscribers:
            queue.put_events(events)
            if queue.buffered_bytes > queue.limit_bytes:
                lagging = [*(lagging or ()), queue]
        if lagging:
            for queue in lagging:
                if is_cumulative:
                    self._coalesce(queue, events[-1])
                else:
                    self._cut_off(queue)

    @staticmethod
    def _remember_latest(history: list[bytes], data: bytes) -> None:
        """Cumulative /generate chunks: the newest chunk of a choice holds all its earlier ones (what replay
        and continuation read from them, server/assemble.py), so the history keeps one chunk per choice.
        Keeping them all grows with the square of the length: measured 150 KB per stream after 120 tokens,
        megabytes after a thousand (docs/benchmarks.md)."""
        index = index_of(data) if has_index(data) else None
        if index is None:  # one choice, the usual case
            history.clear()
            history.append(data)
            return
        for position, earlier in enumerate(history):
            if index_of(earlier) == index:
                history[position] = data
                return
        history.append(data)

    def _coalesce(self, queue: Outbox, latest: bytes) -> None:
        """SGLang's /generate stream is cumulative: each chunk holds everything before it, so a reader that
        lags needs only the newest one. Nothing is lost and the buffer shrinks to one chunk."""
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(latest)

    def _cut_off(self, queue: Outbox) -> None:
        """A subscriber fell too far behind: drop what it has not read and end it with an error, so a slow
        reader never makes the gateway buffer a whole generation for it. Its handler writes the error if the
        client ever reads again; when it was the last reader, `on_abandoned` tells the driver at once (the
        handler may stay blocked on the socket until the app's watchdog cuts it), so the generation is
        aborted after the retry grace instead of running to its end for nobody."""
        self.subscribers.remove(queue)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_too_slow(self.max_buffered_bytes))
        if not self.subscribers and self.on_abandoned is not None:
            self.on_abandoned(self)

    def cancel_upstream(self) -> None:
        task = self.upstream_task
        self.upstream_task = None
        if task is not None and not task.done():
            task.cancel()
