"""Events and commands validate themselves at construction (the contract with the edges)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.core.clock import ManualClock
from rolloutgate.core.events import EngineJoined, ProgressReported, RequestArrived, RequestLimits
from rolloutgate.core.timing import TimingBreakdown


@pytest.mark.parametrize(
    "build",
    [
        lambda: RequestLimits(timeout_s=0.0),
        lambda: RequestLimits(stall_timeout_s=math.nan),
        lambda: RequestLimits(queue_timeout_s=-1.0),
        lambda: RequestArrived(request_id=""),
        lambda: RequestArrived(request_id="r", prompt_tokens=-1),
        lambda: ProgressReported(request_id="r", tokens=-1),
        lambda: EngineJoined(engine_id="", capacity=1),
        lambda: EngineJoined(engine_id="e", capacity=0),
        lambda: EngineJoined(engine_id="e", capacity=1, prefill_token_budget=0),
        lambda: ManualClock().advance(-1.0),
    ],
)
def test_invalid_values_raise(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_new_fields_default_to_the_current_attempt() -> None:
    assert ProgressReported(request_id="r").attempt is None
    clock = ManualClock(start_at=5.0)
    assert clock.advance(1.5) == 6.5 and clock.now() == 6.5 and repr(clock) == "<ManualClock now=6.500>"


def test_timing_breakdown_renders() -> None:
    t = TimingBreakdown(
        wall_s=2.0, queue_s=0.5, paused_s=0.0, contention_s=0.25, charged_s=1.25, stall_s=0.1,
        dispatched_s=1.5, attempts=1, engine_id="e1", tokens=7,
    )  # fmt: skip
    assert t.as_dict()["charged_s"] == 1.25 and t.as_dict()["engine_id"] == "e1"
    assert t.header_value().startswith("wall=2.000;queue=0.500;paused=0.000;contention=0.250;charged=1.250")


_SECONDS = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(values=st.lists(_SECONDS, min_size=7, max_size=7), attempts=st.integers(0, 99))
def test_timing_header_rounds_each_clock_to_the_millisecond(values: list[float], attempts: int) -> None:
    wall, queue, paused, contention, charged, stall, forgiven = values
    t = TimingBreakdown(
        wall_s=wall, queue_s=queue, paused_s=paused, contention_s=contention, charged_s=charged,
        stall_s=stall, dispatched_s=0.0, attempts=attempts, forgiven_s=forgiven,
    )  # fmt: skip
    assert t.header_value() == (
        f"wall={wall:.3f};queue={queue:.3f};paused={paused:.3f};contention={contention:.3f};"
        f"charged={charged:.3f};stall={stall:.3f};forgiven={forgiven:.3f};attempts={attempts}"
    )
