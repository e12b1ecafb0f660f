"""An engine's output path: the one Python process that builds and serialises every answer it sends.

In SGLang that is the tokenizer manager (the HTTP server process): for every output of every request it
builds the result dict (for a cumulative `/generate` stream: all text, output_ids and logprobs so far), and
the handler `orjson.dumps` it and writes it. In vLLM it is the API server process (detokenizer, output
processor, OpenAI serialisation). One process per engine, so a serial resource: when a gateway asks for
cumulative streams at `stream_interval` 1, chunk k repeats k tokens, the work per request grows with the
square of its length, the process saturates, and every answer of that engine leaves late.

Theory of operation (all times simulated seconds):

- `OutputPath` (sans-IO, one per `EngineModel`): a FIFO single server. An item (one stream chunk, or one
  whole non-streamed body) that is *ready* at `ready_at` (the simulated time the engine produced the output
  it carries) and serialises to `nbytes` starts at `max(ready_at, free_at)` and is done
  `output_chunk_s + nbytes / output_bytes_per_s` later. It also keeps the counters `/metrics` exposes.
- `OutputQueue` (asyncio, one per `SimEngine`): handlers hand it their items and await their slots. Items
  are booked once per event-loop iteration, sorted by `ready_at`, so the handlers woken by one driver wake-up
  are served in the order their outputs were produced, whatever order the handlers happen to run in; then
  each handler sleeps until its last item is done (in scaled real time) before it writes. A handler that was
  itself held back by the queue books its next items behind everything booked meanwhile (FIFO).
- `token_ready_at(req, count)`: the simulated time token `count` of a streamed request was produced, from
  the request's emission log (the model appends one entry per token burst; the handler consumes it).

Health probes never go through the output path (SGLang's /health does, in the real engine; here it keeps
answering). Nothing is charged when the config sets the cost to zero (`fast` profile); the counters count
anyway.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutgate.runtime_clock import LoopClock
    from rolloutsim.profiles import SimEngineConfig
    from rolloutsim.request import SimRequest

__all__ = ("MIN_SLEEP_REAL_S", "OutputPath", "OutputQueue", "Slot", "token_ready_at")

# a handler held back by the queue sleeps only when the wait is at least this long in real time (the driver
# delivers tokens in bursts of >= 2 ms anyway); simulated-time results (e2e_latency, answered_at) are exact
MIN_SLEEP_REAL_S = 0.001

Slot = tuple[float, float]  # (start_at, done_at) of one item on the output path


class OutputPath:
    """One engine's output queue arithmetic and counters (see the module docstring)."""

    __slots__ = ("_booked_s", "bytes_per_s", "bytes_total", "chunk_s", "chunks_total", "free_at")

    def __init__(self, config: SimEngineConfig) -> None:
        self.bytes_per_s = config.output_bytes_per_s
        self.chunk_s = config.output_chunk_s
        self.free_at = 0.0  # when the queue has served everything booked so far
        self.bytes_total = 0  # bytes of bodies and stream chunks serialised for generation answers
        self.chunks_total = 0  # stream chunks and whole bodies
        self._booked_s = 0.0  # service time of everything booked (busy_s subtracts what lies ahead)

    @property
    def enabled(self) -> bool:
        return self.chunk_s > 0 or not math.isinf(self.bytes_per_s)

    def cost_s(self, nbytes: int) -> float:
        """Service time of one item of `nbytes`."""
        return self.chunk_s + (0.0 if math.isinf(self.bytes_per_s) else nbytes / self.bytes_per_s)

    def book(self, ready_at: float, nbytes: int) -> Slot:
        """Queue one item behind everything booked before it; returns its (start_at, done_at)."""
        start = max(ready_at, self.free_at)
        cost = self.cost_s(nbytes)
        self.free_at = start + cost
        self._booked_s += cost
        return start, self.free_at

    def count(self, nbytes: int, chunks: int = 1) -> None:
        """Count output that was serialised (called with the exact bytes that are written)."""
        self.bytes_total += nbytes
        self.chunks_total += chunks

    def busy_s(self, now: float) -> float:
        """Simulated seconds the queue has been busy up to `now` (booked work ahead of `now` excluded)."""
        return self._booked_s - self.backlog_s(now)

    def backlog_s(self, now: float) -> float:
        """How long the queue stays busy after `now` with what is booked."""
        return max(0.0, self.free_at - now)

    def reset(self, now: float) -> None:
        """The process died (crash): work not yet done is lost; the counters stay, like the engine's."""
        self._booked_s -= self.backlog_s(now)
        self.free_at = min(self.free_at, now)

    def __repr__(self) -> str:
        return (
            f"<OutputPath {self.chunks_total} chunks, {self.bytes_total} bytes, free at {self.free_at:.6f}>"
        )


class OutputQueue:
    """The asyncio side of an engine's `OutputPath`: books items once per loop iteration, in ready order."""

    __slots__ = ("_pending", "_scheduled", "clock", "path")

    def __init__(self, path: OutputPath, clock: LoopClock) -> None:
        self.path = path
        self.clock = clock
        self._pending: list[tuple[list[tuple[float, int]], asyncio.Future[list[Slot]]]] = []
        self._scheduled = False

    async def serialise(self, items: list[tuple[float, int]]) -> list[Slot]:
        """Book `items` ((ready_at, nbytes) each, in the order they will be written); their slots, in order."""
        if not self.path.enabled:
            return [(ready, ready) for ready, _ in items]
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Slot]] = loop.create_future()
        self._pending.append((items, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        # every item of this iteration in the order its output was produced (ties: handler, then its order)
        order = sorted(
            (ready, n, k, nbytes)
            for n, (items, _future) in enumerate(pending)
            for k, (ready, nbytes) in enumerate(items)
        )
        slots: list[list[Slot]] = [[(0.0, 0.0)] * len(items) for items, _future in pending]
        for ready, n, k, nbytes in order:
            if not pending[n][1].done():  # a handler cancelled meanwhile has nobody to serialise for
                slots[n][k] = self.path.book(ready, nbytes)
        for n, (_items, future) in enumerate(pending):
            if not future.done():
                future.set_result(slots[n])

    async def wait(self, done_at: float) -> None:
        """Sleep until simulated time `done_at` (no sleep for waits under MIN_SLEEP_REAL_S)."""
        delay = self.clock.real_seconds(done_at - self.clock.now())
        if delay >= MIN_SLEEP_REAL_S:
            await asyncio.sleep(delay)


def token_ready_at(req: SimRequest, count: int) -> float | None:
    """When token `count` (1-based) of `req` was produced, from its emission log (None: not logged).

    Entries wholly before `count` are dropped: a stream's marks only grow.
    """
    log = req.emit_log
    if log is None:
        return None
    while log:
        before, n, at, times = log[0]
        if count <= before + n:
            if count <= before or times is None:
                return at
            return times[count - before - 1]
        log.popleft()
    return None
