"""Engine-level progress for the calls an engine answers whole (core/engine_watch.py decides; this polls).

Theory of operation: while an engine has watched calls in flight (a non-streaming client's, whose answer
comes as one body, or SGLang `/generate`'s first token and end), one task per engine reads the engine's load
every `poll_s` real seconds (`EngineClient.load()`: SGLang's generated-token counter in `/metrics`, else
`/v1/loads`; vLLM's `/metrics`) and hands the core tracker the tokens generated since the last reading; the
progress events it returns go to the driver. A reading that fails, or shows nothing new, is no progress: the
core's liveness judges the silence. The poll interval bounds how much later than per-token watching a frozen
engine is caught (settings.engine_poll_interval, a twentieth of the stall timeout by default).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from rolloutgate.core.engine_watch import EngineWatch
from rolloutgate.core.events import Event
from rolloutgate.engines.base import EngineClient, EngineLoad, UpstreamError

__all__ = ("EngineWatcher", "tokens_between")


def tokens_between(earlier: EngineLoad | None, later: EngineLoad, elapsed_s: float) -> float:
    """Tokens the engine generated between two readings `elapsed_s` gateway seconds apart.

    The counter when both readings have it (a smaller value means the engine restarted: count from zero);
    else the reported rate times the time between, but only when the engine's snapshot moved (a frozen SGLang
    keeps reporting the rate of its last decode log)."""
    if earlier is None:
        return 0.0
    if later.generated_tokens_total is not None and earlier.generated_tokens_total is not None:
        delta = later.generated_tokens_total - earlier.generated_tokens_total
        return later.generated_tokens_total if delta < 0 else delta
    rate = later.gen_throughput
    if rate is None or rate <= 0 or elapsed_s <= 0:
        return 0.0
    if later.snapshot_at is not None and later.snapshot_at == earlier.snapshot_at:
        return 0.0
    return rate * elapsed_s


class EngineWatcher:
    def __init__(self, emit: Callable[[Event], None], now: Callable[[], float], poll_s: float) -> None:
        self._emit = emit
        self._now = now  # gateway seconds
        self._poll_s = poll_s  # real seconds
        self.watch = EngineWatch()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def add(
        self, engine_id: str, client: EngineClient, request_id: str, attempt: int, max_new_tokens: int | None
    ) -> None:
        self.watch.add(engine_id, request_id, attempt, max_new_tokens)
        if engine_id not in self._tasks:
            self._tasks[engine_id] = asyncio.get_running_loop().create_task(self._poll(engine_id, client))

    def remove(self, request_id: str) -> None:
        self.watch.remove(request_id)

    async def _poll(self, engine_id: str, client: EngineClient) -> None:
        last: EngineLoad | None = None
        last_at = self._now()
        first = True
        try:
            while self.watch.is_watching(engine_id):
                if not first:  # the first reading at once: the next one's tokens count from the start
                    await asyncio.sleep(self._poll_s)
                    if not self.watch.is_watching(engine_id):
                        break  # its calls ended while it slept: no reading for nobody
                first = False
                try:
                    load = await client.load()
                except UpstreamError:
                    continue  # no reading: no progress; liveness judges the silence
                now = self._now()
                generated = tokens_between(last, load, now - last_at)
                last, last_at = load, now
                for event in self.watch.observe(engine_id, generated, load.running + load.waiting):
                    self._emit(event)
        finally:
            self._tasks.pop(engine_id, None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
