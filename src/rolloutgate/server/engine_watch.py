"""Engine-level progress for the calls an engine answers whole (core/engine_watch.py decides; this polls).

Theory of operation: while an engine has watched calls in flight (a non-streaming client's, whose answer
comes as one body, or SGLang `/generate`'s first token and end), one task per engine reads the engine's load
every `poll_s` real seconds, the first reading a sixth of that after the first such call (so calls answered
sooner cost the engine no reading), with `EngineClient.load()` (SGLang's generated-token counter in
`/metrics`, else `/v1/loads`; vLLM's `/metrics`), and hands the core tracker the tokens generated since the
last reading; the progress events it returns go to the driver. A reading that fails, or shows nothing new,
is no progress: the core's liveness judges the silence. The poll interval bounds how much later than
per-token watching a frozen engine is caught (settings.engine_poll_interval, a twentieth of the stall timeout
by default).
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


class _Readings:
    """One engine's counter readings: the last one, its decode rate, and when its last counted token came."""

    __slots__ = ("last", "last_at", "lock", "output_at", "progressing", "rate")

    def __init__(self, now: float) -> None:
        self.last: EngineLoad | None = None
        self.last_at = now
        self.rate = 0.0  # tokens per second over the last whole interval of decoding; 0 until one was seen
        self.progressing = False  # the last reading showed tokens: the next interval began with it decoding
        self.output_at: float | None = None  # the estimated moment of its last counted token
        self.lock = asyncio.Lock()  # the poll and a pause's reading (`output_at`) take turns

    def take(self, load: EngineLoad, now: float) -> float:
        """Take a reading at `now`; the tokens generated since the last one.

        A reading only says how many tokens came in its interval, not when. When that interval was cut short
        by a pause, they came at its start: at the rate of the last whole interval they took `tokens / rate`
        of it, and the last one came then, not at the reading (a pause's silence counts from there:
        core/events.py EnginePaused). A whole interval is one that began with the engine decoding (the
        reading before showed tokens): one that began in a prefill or a pause would understate the rate.
        Until one was seen, the rate the engine reports stands in (SGLang's `gen_throughput`), and the poll
        reads more often (`EngineWatcher`)."""
        elapsed = now - self.last_at
        generated = tokens_between(self.last, load, elapsed)
        if generated > 0:
            rate = self.rate if self.rate > 0 else (load.gen_throughput or 0.0)
            busy_s = elapsed if rate <= 0 else min(elapsed, generated / rate)
            self.output_at = self.last_at + busy_s
            if self.progressing and elapsed > 0:
                self.rate = generated / elapsed
        self.progressing = generated > 0
        self.last, self.last_at = load, now
        return generated


# While an engine's decode rate is not known yet, the poll reads this much more often: a pause in the first
# poll interval of a call would otherwise be placed at the reading after it, up to a whole poll late.
FIRST_READINGS_SPEEDUP = 6


class EngineWatcher:
    def __init__(self, emit: Callable[[Event], None], now: Callable[[], float], poll_s: float) -> None:
        self._emit = emit
        self._now = now  # gateway seconds
        self._poll_s = poll_s  # real seconds
        self.watch = EngineWatch()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._clients: dict[str, EngineClient] = {}
        self._readings: dict[str, _Readings] = {}

    def add(
        self, engine_id: str, client: EngineClient, request_id: str, attempt: int, max_new_tokens: int | None
    ) -> None:
        self.watch.add(engine_id, request_id, attempt, max_new_tokens)
        if engine_id not in self._tasks:
            self._clients[engine_id] = client
            self._readings[engine_id] = _Readings(self._now())
            self._tasks[engine_id] = asyncio.get_running_loop().create_task(self._poll(engine_id, client))

    def remove(self, request_id: str) -> None:
        self.watch.remove(request_id)

    async def output_at(self, engine_id: str) -> float | None:
        """When the engine's last token came, as its counter shows it now (a reading taken at once, its
        progress handed to the core first); None when no call on it is watched, or it cannot be read."""
        readings, client = self._readings.get(engine_id), self._clients.get(engine_id)
        if readings is None or client is None:
            return None
        await self._read(engine_id, client, readings)
        return readings.output_at

    async def _read(self, engine_id: str, client: EngineClient, readings: _Readings) -> None:
        async with readings.lock:
            try:
                load = await client.load()
            except UpstreamError:
                return  # no reading: no progress; liveness judges the silence
            generated = readings.take(load, self._now())
        for event in self.watch.observe(engine_id, generated, load.running + load.waiting):
            self._emit(event)

    async def _poll(self, engine_id: str, client: EngineClient) -> None:
        readings = self._readings[engine_id]
        try:
            while True:
                # The first reading, the baseline, comes a fast interval after the engine's first watched call,
                # not at once: a call answered sooner costs the engine no reading (one client's calls in turn
                # each cost a /metrics read, a tenth of the gateway's CPU per call, when it came at once). The
                # first token and the end of each call come on its own stream anyway.
                known = readings.rate > 0
                await asyncio.sleep(self._poll_s if known else self._poll_s / FIRST_READINGS_SPEEDUP)
                if not self.watch.is_watching(engine_id):
                    break  # its calls ended while it slept: no reading for nobody
                await self._read(engine_id, client, readings)
        finally:
            self._tasks.pop(engine_id, None)
            self._clients.pop(engine_id, None)
            self._readings.pop(engine_id, None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
