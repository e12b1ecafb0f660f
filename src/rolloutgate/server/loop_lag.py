"""How late the gateway's event loop runs what is due: its own saturation, as a metric.

Theory of operation: every request's work, every upstream event and every timer share one event loop; when
that loop has more ready work than one core runs, everything waits, and a Python gateway's latency and
timeouts come from there (rllm#727: a gateway's loop saturated at 200-378 requests in flight, ~47% of rollouts
timed out). A timer callback asks to run every `interval_s` and records how much later than asked it ran: the
time a callback due then waited for the loop. Observed into `rolloutgate_event_loop_lag_seconds`. A plain
callback, not a task, four times a second: an idle gateway's CPU measured over a minute, a task waking 20 times
a second cost 3.7 ms of CPU a second (~10% of the gateway's CPU per token in `make bench-rl`), a timer callback
10 times a second 1.5 ms (the loop's own wake-up, mostly; under load the loop is awake anyway).
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

__all__ = ("LAG_BUCKETS", "LoopLagWatch")

# Seconds: a healthy loop is late by well under a millisecond; 10 ms and up is a loop falling behind.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
INTERVAL_S = 0.25


class LoopLagWatch:
    """From `start()` until `stop()`: every `interval_s`, how late the loop ran its timer, observed."""

    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
        self._histogram = histogram
        self._interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._due = self._loop.time() + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self._histogram.observe(max(0.0, now - self._due))
        self._due = now + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)
