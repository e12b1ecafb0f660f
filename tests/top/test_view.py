"""The view model: snapshots in, rows and rates out (pure; hand-made snapshots, tests/top/helpers.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutgate.top.view import HUNG_SHARE, build_view, engine_state
from tests.top.helpers import engine, snapshot, unreachable

WINDOW = 60.0


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, "healthy"),
        ({"prefilling": True}, "prefilling"),
        ({"paused_by_gate": True}, "paused by gate"),
        ({"paused_by_engine": True, "paused_by_gate": False}, "paused by trainer"),
        ({"silent_s": HUNG_SHARE * 60.0, "hung_after_s": 60.0}, "hung"),
        ({"silent_s": HUNG_SHARE * 60.0 - 0.1, "hung_after_s": 60.0}, "healthy"),
        (
            {"silent_s": 40.0, "hung_after_s": 60.0, "prefilling": True},
            "hung",
        ),  # silent past its allowance share
        ({"silent_s": 40.0, "hung_after_s": 60.0, "paused_by_gate": True}, "paused by gate"),
        ({"state": "quarantined", "quarantined": True, "healthy": False}, "quarantined"),
        ({"state": "unhealthy", "healthy": False}, "unhealthy"),
        ({"state": None, "healthy": False}, "joining"),
    ],
)
def test_an_engines_state_is_named_in_order(fields: dict[str, Any], expected: str) -> None:
    assert engine_state(engine(**fields)) == expected


def test_one_reading_shows_state_and_load_but_no_rates() -> None:
    view = build_view(
        [[snapshot(10.0, [engine(running=3, queued=2, capacity=8, generated_tokens=500)], queue_depth=4)]]
    )
    (row,) = view.engines
    assert (row.state, row.running, row.capacity, row.queued) == ("healthy", 3, 8.0, 2)
    assert row.tokens_per_s is None and view.tokens_per_s is None
    assert view.timeouts_per_min is None and view.wasted_per_s is None
    assert (view.queue_depth, view.in_flight, view.capacity) == (4, 3, 8.0)


def test_tokens_per_second_come_from_the_two_newest_readings() -> None:
    first = snapshot(0.0, [engine("engine-0", generated_tokens=100), engine("engine-1", generated_tokens=0)])
    second = snapshot(
        8.0,
        [engine("engine-0", generated_tokens=900), engine("engine-1", generated_tokens=40)],
        generated=2000,
    )
    third = snapshot(
        10.0,
        [engine("engine-0", generated_tokens=1500), engine("engine-1", generated_tokens=40)],
        generated=3000,
    )
    view = build_view([[first], [second], [third]])
    assert view.tokens_per_s == pytest.approx((3000 - 2000) / 2.0)
    rates = {row.engine_id: row.tokens_per_s for row in view.engines}
    assert rates == {"engine-0": pytest.approx((1500 - 900) / 2.0), "engine-1": 0.0}


def test_failures_per_minute_come_from_the_failure_counters_over_the_window() -> None:
    start = snapshot(0.0, failures={"timeout": 1, "stall": 0, "queue_full": 5}, quarantines={"engine-0": 0})
    middle = snapshot(15.0, failures={"timeout": 2, "stall": 0, "queue_full": 5}, quarantines={"engine-0": 0})
    end = snapshot(
        30.0,
        failures={"timeout": 4, "stall": 1, "queue_full": 8, "max_wall": 1},
        quarantines={"engine-0": 1},
    )
    view = build_view([[start], [middle], [end]])
    minutes = 30.0 / 60.0
    assert view.timeouts_per_min == pytest.approx((4 - 1 + 1) / minutes)  # timeout + max_wall
    assert view.stalls_per_min == pytest.approx(1 / minutes)
    assert view.quarantines_per_min == pytest.approx(1 / minutes)
    assert view.failures_per_min is not None
    assert view.failures_per_min["queue_full"] == pytest.approx(3 / minutes)
    assert view.window_s == 30.0


def test_the_clocks_split_is_of_the_requests_that_finished_in_the_window() -> None:
    before = {"wall": (10, 100.0), "queue": (10, 50.0), "paused": (10, 0.0), "contention": (10, 0.0)}
    before["charged"] = (10, 50.0)
    after = {"wall": (14, 300.0), "queue": (14, 60.0), "paused": (14, 40.0), "contention": (14, 30.0)}
    after["charged"] = (14, 170.0)
    view = build_view([[snapshot(0.0, clocks=before)], [snapshot(20.0, clocks=after)]])
    split = view.split
    assert (split.requests, split.wall_s, split.span_s) == (4, 200.0, 20.0)
    assert split.share("queue") == pytest.approx(10 / 200)
    assert split.share("paused") == pytest.approx(40 / 200)
    assert split.share("contention") == pytest.approx(30 / 200)
    assert split.share("charged") == pytest.approx(120 / 200)


def test_with_one_reading_the_split_is_since_start() -> None:
    clocks = {"wall": (2, 10.0), "queue": (2, 1.0), "paused": (2, 0.0), "contention": (2, 2.0)}
    clocks["charged"] = (2, 7.0)
    split = build_view([[snapshot(5.0, clocks=clocks)]]).split
    assert (split.requests, split.span_s, split.share("charged")) == (2, None, pytest.approx(0.7))


def test_a_counter_that_went_down_counts_from_zero() -> None:
    """The gateway restarted between two readings: its counters start again."""
    view = build_view([[snapshot(0.0, generated=10_000)], [snapshot(4.0, generated=400)]])
    assert view.tokens_per_s == pytest.approx(400 / 4.0)


def test_wasted_engine_seconds_are_summed_by_reason_with_their_rate() -> None:
    view = build_view(
        [
            [snapshot(0.0, wasted={"timeout": 100.0, "stall": 0.0})],
            [snapshot(10.0, wasted={"timeout": 130.0, "stall": 20.0})],
        ]
    )
    assert view.wasted_engine_s == pytest.approx(150.0)
    assert view.wasted_by_reason == {"timeout": 130.0, "stall": 20.0}
    assert view.wasted_per_s == pytest.approx((150.0 - 100.0) / 10.0)


def test_series_a_gateway_does_not_export_are_none_not_zero() -> None:
    view = build_view([[snapshot(0.0)], [snapshot(1.0)]])
    assert view.wasted_engine_s is None and view.wasted_per_s is None
    assert all(row.cache_hit_rate is None for row in view.engines)


def test_the_prefix_cache_hit_rate_is_per_engine_over_the_window() -> None:
    engines = [engine("engine-0"), engine("engine-1")]
    first = snapshot(
        0.0, engines, prompt_tokens={"engine-0": 1000, "engine-1": 500}, cached_tokens={"engine-0": 0}
    )
    second = snapshot(
        10.0,
        engines,
        prompt_tokens={"engine-0": 5000, "engine-1": 500},
        cached_tokens={"engine-0": 3000, "engine-1": 100},
    )
    rates = {row.engine_id: row.cache_hit_rate for row in build_view([[first], [second]]).engines}
    # engine-0: 3,000 of the window's 4,000 prompt tokens; engine-1 got no prompt in the window: since start
    assert rates == {"engine-0": pytest.approx(3000 / 4000), "engine-1": pytest.approx(100 / 500)}


def test_a_fleet_shows_every_replicas_engines_and_sums_their_rates() -> None:
    def fleet(at: float, tokens: tuple[int, int]) -> list[Any]:
        return [
            snapshot(at, [engine("engine-0", running=2)], url="http://a", replica_id="replica-0",
                     generated=tokens[0], queue_depth=1),
            snapshot(at + 0.5, [engine("engine-0", running=5), engine("engine-1")], url="http://b",
                     replica_id="replica-1", generated=tokens[1], queue_depth=2),
        ]  # fmt: skip

    view = build_view([fleet(0.0, (0, 0)), fleet(2.0, (400, 1000))])
    assert [(row.replica, row.engine_id, row.running) for row in view.engines] == [
        ("replica-0", "engine-0", 2),
        ("replica-1", "engine-0", 5),
        ("replica-1", "engine-1", 0),
    ]
    assert view.tokens_per_s == pytest.approx(400 / 2.0 + 1000 / 2.0)
    assert (view.queue_depth, view.in_flight) == (3, 7)
    assert [g.key for g in view.gateways] == ["replica-0", "replica-1"]


def test_an_unreachable_replica_is_shown_and_the_others_still_count() -> None:
    first = [snapshot(0.0, replica_id="replica-0", generated=0), unreachable(0.0, replica_id="replica-1")]
    second = [snapshot(1.0, replica_id="replica-0", generated=50), unreachable(1.0, replica_id="replica-1")]
    view = build_view([first, second])
    assert [(g.key, g.error) for g in view.gateways] == [
        ("replica-0", None),
        ("replica-1", "connection refused"),
    ]
    assert [row.replica for row in view.engines] == ["replica-0"]
    assert view.tokens_per_s == pytest.approx(50.0)


def test_a_closed_gate_is_shown_with_its_mode_and_time() -> None:
    gate = {"open": False, "mode": "in_place", "closed_for_s": 12.4, "last_update": None}
    view = build_view([[snapshot(0.0, [engine(paused_by_gate=True)], gate=gate)]])
    assert view.gateways[0].gate == "closed (in_place) 12s"
    assert view.engines[0].state == "paused by gate"


def test_a_counter_exported_with_no_sample_yet_is_zero() -> None:
    """A labelled counter none of whose labels was used yet (no request failed): exported, so 0, not "-"."""
    view = build_view([[snapshot(0.0, wasted={})], [snapshot(1.0, wasted={})]])
    assert (view.wasted_engine_s, view.wasted_per_s, view.wasted_by_reason) == (0.0, 0.0, {})
