"""How late the gateway's event loop runs what is due: its own saturation, as a metric.

Theory of operation: every request's work, every upstream event and every timer share one event loop; when
that loop has more ready work than one core runs, everything waits, and a Python gateway's latency and
timeouts come from there (rllm#727: a gateway's loop saturated at 200-378 requests in flight, ~47% of rollouts
timed out). A task asks to wake every `interval_s` and records how much later than asked it woke: the time a
callback due then waited for the loop. Observed into `rolloutgate_event_loop_lag_seconds`; at 20 wake-ups a
second it costs ~20 us of CPU a second.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

__all__ = ("LAG_BUCKETS", "watch_loop_lag")

# Seconds: a healthy loop is late by well under a millisecond; 10 ms and up is a loop falling behind.
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
INTERVAL_S = 0.05


async def watch_loop_lag(histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
    """Until cancelled: wake every `interval_s`, observe how late."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, loop.time() - due))
