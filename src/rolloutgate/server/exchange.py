"""One client request at the edge: what its handler is waiting for, and what its upstream attempts produced.

Theory of operation: the front handler creates an `Exchange`, submits it to the driver and then only reads
its `outbox`. The driver's upstream task puts what the client must see into the outbox: stream events
(streaming clients), then exactly one terminal item, `Finished` (the answer, or the end of the stream) or a
`GatewayError`. The handler decides how to write them (headers now or later, keep-alive, error framing).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.engines.assemble import ResponseAssembler
from rolloutgate.engines.base import Route, UpstreamError
from rolloutgate.errors import GatewayError

__all__ = ("Exchange", "Finished", "OutboxItem")


@dataclass(frozen=True, slots=True)
class Finished:
    """The request completed. `body` is the assembled answer for a non-streaming client (None for a stream)."""

    timing: TimingBreakdown
    body: bytes | None = None
    engine_url: str | None = None


OutboxItem = bytes | Finished | GatewayError  # bytes: one stream event's JSON data, forwarded as SSE


@dataclass(eq=False, slots=True)
class Exchange:
    request_id: str
    route: Route
    body: dict[str, Any]
    client_streams: bool
    forward_headers: dict[str, str] = field(default_factory=dict)
    wants_usage: bool = False  # a streaming client asked for the usage frame (stream_options.include_usage)
    outbox: asyncio.Queue[OutboxItem] = field(default_factory=asyncio.Queue)
    # upstream state, owned by the driver
    attempt: int = 0
    engine_id: str | None = None
    engine_url: str | None = None
    upstream_task: asyncio.Task[None] | None = None
    assembler: ResponseAssembler | None = None  # this attempt's answer so far (non-streaming clients)
    delivered_tokens: int = 0  # tokens a streaming client has already been sent
    upstream_error: UpstreamError | None = None  # the engine's own non-retryable error, passed through
    ended: bool = False

    def finish(self, item: Finished | GatewayError) -> None:
        if not self.ended:
            self.ended = True
            self.outbox.put_nowait(item)

    def send_event(self, data: bytes) -> None:
        if not self.ended:
            self.outbox.put_nowait(data)

    def cancel_upstream(self) -> None:
        task = self.upstream_task
        self.upstream_task = None
        if task is not None and not task.done():
            task.cancel()
