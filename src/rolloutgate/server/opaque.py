"""Engine-level progress for requests an engine cannot stream (DESIGN.md: "where an upstream cannot stream a
request, engine-level progress stands in").

Theory of operation: some calls come back only as a whole body (SGLang chat with `return_meta_info`, which it
refuses to stream), so the gateway sees no per-request progress until the end, and liveness would take a long
generation for a hang. While an engine has such "opaque" requests in flight, a watcher polls the engine's load
every `poll_s` (real seconds) and, when the engine shows it generated something since the last poll, reports
progress (0 tokens) for each of its opaque requests. A frozen engine shows none, so it is still caught.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from rolloutgate.core.events import Event, ProgressReported
from rolloutgate.engines.base import EngineClient, EngineLoad, UpstreamError

__all__ = ("OpaqueWatcher",)


class OpaqueWatcher:
    def __init__(self, emit: Callable[[Event], None], poll_s: float) -> None:
        self._emit = emit
        self._poll_s = poll_s
        self._requests: dict[str, dict[str, int]] = {}  # engine id -> request id -> attempt
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def add(self, engine_id: str, client: EngineClient, request_id: str, attempt: int) -> None:
        self._requests.setdefault(engine_id, {})[request_id] = attempt
        if engine_id not in self._tasks:
            self._tasks[engine_id] = asyncio.get_running_loop().create_task(self._watch(engine_id, client))

    def remove(self, engine_id: str | None, request_id: str) -> None:
        if engine_id is not None and engine_id in self._requests:
            self._requests[engine_id].pop(request_id, None)

    async def _watch(self, engine_id: str, client: EngineClient) -> None:
        last: EngineLoad | None = None
        try:
            while self._requests.get(engine_id):
                await asyncio.sleep(self._poll_s)
                try:
                    load = await client.load()
                except UpstreamError:
                    continue  # no reading: no progress; liveness judges the silence
                if load.shows_progress_since(last):
                    for request_id, attempt in list(self._requests.get(engine_id, {}).items()):
                        self._emit(ProgressReported(request_id=request_id, tokens=0, attempt=attempt))
                last = load
        finally:
            self._tasks.pop(engine_id, None)
            self._requests.pop(engine_id, None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
