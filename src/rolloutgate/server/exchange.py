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
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.engines.assemble import ResponseAssembler
from rolloutgate.engines.base import Route, UpstreamError
from rolloutgate.errors import GatewayError, Unavailable
from rolloutgate.server.continuation import GenerateStitcher

__all__ = ("DEFAULT_CLIENT_BUFFER_BYTES", "Exchange", "Finished", "Outbox", "OutboxItem")

DEFAULT_CLIENT_BUFFER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Finished:
    """The request completed. `body` is the assembled answer for a non-streaming client (None for a stream)."""

    timing: TimingBreakdown
    body: bytes | None = None
    engine_url: str | None = None


OutboxItem = bytes | Finished | GatewayError  # bytes: one stream event's JSON data, forwarded as SSE


class Outbox(asyncio.Queue[OutboxItem]):
    """One subscriber's queue; counts the stream bytes waiting in it (how far its client is behind)."""

    buffered_bytes: int
    limit_bytes: int

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)  # type: ignore[misc]
        self.buffered_bytes = 0
        self.limit_bytes = DEFAULT_CLIENT_BUFFER_BYTES

    def _put(self, item: OutboxItem) -> None:
        super()._put(item)  # type: ignore[misc]
        if isinstance(item, bytes):
            self.buffered_bytes += len(item)

    def _get(self) -> OutboxItem:
        item: OutboxItem = super()._get()  # type: ignore[misc]
        if isinstance(item, bytes):
            self.buffered_bytes -= len(item)
        return item


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
    committed: bool = False  # a client already received a 200 (keep-alive): errors must be framed in-body
    # upstream state, owned by the driver
    attempt: int = 0
    engine_id: str | None = None
    engine_url: str | None = None
    upstream_task: asyncio.Task[None] | None = None
    assembler: ResponseAssembler | None = None  # this attempt's answer so far (non-streaming clients)
    delivered_tokens: int = 0  # tokens a streaming client has already been sent
    upstream_error: UpstreamError | None = None  # the engine's own non-retryable error, passed through
    ended: bool = False

    def subscribe(self) -> Outbox:
        """A queue of everything this exchange publishes from now on (stream history first, if kept)."""
        queue = Outbox()
        for data in self.history or ():
            queue.put_nowait(data)
        # The history is shared (no copy), so only what comes after it counts against the limit.
        queue.limit_bytes = self.max_buffered_bytes + queue.buffered_bytes
        self.subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[OutboxItem]) -> bool:
        """Remove a subscriber; True if none is left (the client side is gone)."""
        if queue in self.subscribers:
            self.subscribers.remove(queue)
        return not self.subscribers

    def finish(self, item: Finished | GatewayError) -> None:
        if not self.ended:
            self.ended = True
            for queue in self.subscribers:
                queue.put_nowait(item)

    def send_event(self, data: bytes) -> None:
        if not self.ended:
            if self.history is not None:
                self.history.append(data)
            lagging = None
            for queue in self.subscribers:
                queue.put_nowait(data)
                if queue.buffered_bytes > queue.limit_bytes:
                    lagging = [*(lagging or ()), queue]
            if lagging:
                for queue in lagging:
                    self._cut_off(queue)

    def _cut_off(self, queue: Outbox) -> None:
        """A subscriber fell too far behind: drop what it has not read and end it with an error, so a slow
        reader never makes the gateway buffer a whole generation for it. Its handler then writes the error
        and leaves (front.run_exchange reports the client gone when it was the last one)."""
        self.subscribers.remove(queue)
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(_too_slow(self.max_buffered_bytes))

    def cancel_upstream(self) -> None:
        task = self.upstream_task
        self.upstream_task = None
        if task is not None and not task.done():
            task.cancel()
