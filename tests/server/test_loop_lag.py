"""The event-loop lag watch (server/loop_lag.py): a loop held busy shows as a late timer."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client import CollectorRegistry, Histogram

from rolloutgate.server.loop_lag import LAG_BUCKETS, LoopLagWatch
from tests.server.conftest import MakeGateway


def _counts(histogram: Histogram) -> dict[float, float]:
    """Cumulative count per bucket bound."""
    [family] = list(histogram.collect())
    return {
        float(sample.labels["le"]): sample.value
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


async def test_a_loop_held_busy_is_observed_as_late_by_about_as_long() -> None:
    histogram = Histogram("lag", "lag", buckets=LAG_BUCKETS, registry=CollectorRegistry())
    watch = LoopLagWatch(histogram, interval_s=0.01)
    watch.start()
    try:
        for _ in range(3):
            await asyncio.sleep(0.01)  # the watch runs a few times on a free loop
        time.sleep(0.3)  # noqa: ASYNC251 - the point: the loop held, the watch's timer (due within 10 ms) waits
        for _ in range(3):
            await asyncio.sleep(0.01)
    finally:
        watch.stop()
    counts = _counts(histogram)
    total = counts[float("inf")]
    assert total >= 3
    assert total - counts[0.25] >= 1  # at least one wake-up more than 0.25 s late: the held loop


async def test_the_gateway_exports_its_loop_lag(make_gateway: MakeGateway, http: httpx.AsyncClient) -> None:
    gateway = await make_gateway()
    text = (await http.get(gateway.url + "/metrics")).text
    assert "rolloutgate_event_loop_lag_seconds_bucket" in text
