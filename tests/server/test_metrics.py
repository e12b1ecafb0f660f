"""The gateway's Prometheus metrics (server/metrics.py): the hot-path counters and histograms render as the
standard client's would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.server.metrics import CLOCK_BUCKETS, CLOCKS, LightHistograms, Metrics


def _samples(text: str, name: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            found[key] = float(value)
    return found


def test_generated_tokens_is_a_counter_with_a_total() -> None:
    metrics = Metrics()
    metrics.generated_tokens.inc(64)
    metrics.generated_tokens.inc(3)
    text = metrics.render().decode()
    assert "# TYPE rolloutgate_generated_tokens_total counter" in text
    assert _samples(text, "rolloutgate_generated_tokens_total") == {
        "rolloutgate_generated_tokens_total": 67.0
    }


def test_each_clock_of_a_request_is_observed_once() -> None:
    metrics = Metrics()
    timing = TimingBreakdown(
        wall_s=2.0, queue_s=0.5, paused_s=0.0, contention_s=0.25, charged_s=1.25, stall_s=0.1, dispatched_s=1.5,
        attempts=1,
    )  # fmt: skip
    metrics.observe_timing(timing, outcome="ok")
    metrics.observe_timing(timing, outcome="ok")
    counts = _samples(metrics.render().decode(), "rolloutgate_clock_seconds_count")
    sums = _samples(metrics.render().decode(), "rolloutgate_clock_seconds_sum")
    for clock, seconds in (
        ("wall", 2.0),
        ("queue", 0.5),
        ("paused", 0.0),
        ("contention", 0.25),
        ("charged", 1.25),
    ):
        assert counts[f'rolloutgate_clock_seconds_count{{clock="{clock}"}}'] == 2.0
        assert sums[f'rolloutgate_clock_seconds_sum{{clock="{clock}"}}'] == 2 * seconds


@given(st.lists(st.tuples(st.integers(0, 4), st.floats(0, 5000, allow_nan=False)), max_size=200))
@settings(max_examples=50, deadline=None)
def test_light_histograms_export_what_prometheus_client_histograms_would(
    observations: list[tuple[int, float]],
) -> None:
    reference_registry, light_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "doc", ["clock"], buckets=CLOCK_BUCKETS, registry=reference_registry)
    light = LightHistograms(
        "h_seconds", "doc", label="clock", values=CLOCKS, buckets=CLOCK_BUCKETS, registry=light_registry
    )
    for clock in CLOCKS:
        reference.labels(clock=clock)  # every child exported, observed or not, as the light one does
    for index, value in observations:
        reference.labels(clock=CLOCKS[index]).observe(value)
        light.observe(index, value)
    expected = [
        line for line in generate_latest(reference_registry).decode().splitlines() if "_created" not in line
    ]
    assert sorted(generate_latest(light_registry).decode().splitlines()) == sorted(expected)
