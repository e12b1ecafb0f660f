"""Running a call through `EngineClient.start` the way the tests read it: all its events (`collect`), or as
an async iterator that can be closed early (`stream`: closing it, or cancelling its reader, cancels the
call, as the driver does)."""

from __future__ import annotations

import asyncio
from typing import Any

from rolloutgate.engines.base import UpstreamCall, UpstreamError, UpstreamEvent


async def collect(client: Any, call: UpstreamCall) -> list[UpstreamEvent]:
    """Every event of the call; raises its UpstreamError."""
    events: list[UpstreamEvent] = []
    async for event in stream(client, call):
        events.append(event)
    return events


class stream:
    """The call's events as they come; `aclose()` (or leaving `async with`) cancels the call."""

    def __init__(self, client: Any, call: UpstreamCall) -> None:
        self._queue: asyncio.Queue[UpstreamEvent | UpstreamError | None] = asyncio.Queue()
        self._closed = False
        self._handle = client.start(call, self._on_events, self._on_end)

    def _on_events(self, events: list[UpstreamEvent]) -> bool:
        for event in events:
            self._queue.put_nowait(event)
        return not self._closed

    def _on_end(self, error: UpstreamError | None) -> None:
        self._queue.put_nowait(error)

    def __aiter__(self) -> stream:
        return self

    async def __anext__(self) -> UpstreamEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:  # the reader was cancelled: so is the call, as the driver does
            await self.aclose()
            raise
        if item is None:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, UpstreamError):
            self._closed = True
            raise item
        return item

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._handle.cancel()
        await asyncio.sleep(0)

    async def __aenter__(self) -> stream:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
