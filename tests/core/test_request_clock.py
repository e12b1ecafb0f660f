"""request_clock: the meter's integrals and a request's clocks, exactly, on hand-picked timelines."""

from __future__ import annotations

import math

import pytest

from rolloutgate.core.charge_meter import ChargeClass, ChargeMeter
from rolloutgate.core.request_clock import RequestClock

FREE, SOLO = ChargeClass.FREE, ChargeClass.SOLO


def test_meter_integrates_each_mode() -> None:
    m = ChargeMeter()
    m.set_paused(100.0, False)
    base_free = m.value(FREE, 100.0)
    m.add_large_prefill(110.0)  # 10 s free
    m.add_large_prefill(115.0)  # 5 s solo
    m.remove_large_prefill(125.0)  # 10 s contended
    m.set_paused(130.0, True)  # 5 s solo
    m.set_paused(140.0, False)  # 10 s paused
    m.remove_large_prefill(141.0)  # 1 s solo
    assert m.value(FREE, 150.0) - base_free == pytest.approx(19.0)  # 10 + 9
    assert m.value(SOLO, 150.0) == pytest.approx(11.0)
    assert m.paused_value(150.0) == pytest.approx(10.0)
    assert m.is_running(FREE) and not m.is_running(SOLO)


def test_meter_real_at_is_inf_while_stopped_and_exact_while_running() -> None:
    m = ChargeMeter()
    m.set_paused(0.0, False)
    v = m.value(FREE, 10.0)
    assert m.real_at(FREE, v + 5.0, 10.0) == pytest.approx(15.0)
    assert m.real_at(SOLO, 1.0, 10.0) == math.inf
    assert m.real_at(FREE, math.inf, 10.0) == math.inf
    m.set_paused(10.0, True)
    assert m.real_at(FREE, v + 5.0, 12.0) == math.inf


def test_remove_without_prefill_raises() -> None:
    with pytest.raises(ValueError):
        ChargeMeter().remove_large_prefill(1.0)


def _clock(at: float = 0.0) -> RequestClock:
    return RequestClock(arrived_at=at, timeout_s=100.0, stall_timeout_s=10.0)


def test_queue_time_is_not_charged_and_paused_queue_time_is_paused() -> None:
    pool, engine = ChargeMeter(), ChargeMeter()
    c = _clock()
    c.start_queued(pool, 0.0)
    pool.set_paused(10.0, True)  # gate closed for 5 s while queued
    pool.set_paused(15.0, False)
    c.start_dispatched(engine, FREE, 30.0)
    b = c.breakdown(50.0, attempts=1, engine_id="e", tokens=0)
    assert (b.wall_s, b.queue_s, b.paused_s, b.dispatched_s, b.charged_s, b.contention_s) == pytest.approx(
        (50.0, 25.0, 5.0, 20.0, 20.0, 0.0)
    )


@pytest.mark.parametrize(
    ("steps", "charged", "contention", "paused"),
    [
        # (time, action) on the engine meter; the request is FREE class, dispatched at t=0, read at t=100
        ([], 100.0, 0.0, 0.0),
        ([(20, "big+"), (50, "big-")], 70.0, 30.0, 0.0),
        ([(20, "pause"), (40, "resume")], 80.0, 0.0, 20.0),
        ([(10, "big+"), (20, "pause"), (30, "resume"), (40, "big-")], 70.0, 20.0, 10.0),  # paused wins
        ([(10, "big+"), (20, "big+"), (30, "big-"), (40, "big-")], 70.0, 30.0, 0.0),
    ],
)
def test_charged_is_dispatched_minus_paused_minus_contention(
    steps: list[tuple[float, str]], charged: float, contention: float, paused: float
) -> None:
    engine = ChargeMeter()
    c = _clock()
    c.start_dispatched(engine, FREE, 0.0)
    for at, action in steps:
        if action == "big+":
            engine.add_large_prefill(at)
        elif action == "big-":
            engine.remove_large_prefill(at)
        else:
            engine.set_paused(at, action == "pause")
    b = c.breakdown(100.0, attempts=1, engine_id="e", tokens=0)
    assert (b.charged_s, b.contention_s, b.paused_s, b.dispatched_s) == pytest.approx(
        (charged, contention, paused, 100.0)
    )
    assert b.charged_s == pytest.approx(b.dispatched_s - b.paused_s - b.contention_s)


def test_own_large_prefill_is_charged_only_while_alone() -> None:
    engine = ChargeMeter()
    c = _clock()
    engine.add_large_prefill(0.0)  # its own prefill
    c.start_dispatched(engine, SOLO, 0.0)
    engine.add_large_prefill(10.0)  # another one: contention for both
    engine.remove_large_prefill(25.0)
    engine.remove_large_prefill(30.0)  # its own prefill ends
    c.switch_class(FREE, 30.0)
    b = c.breakdown(40.0, attempts=1, engine_id="e", tokens=0)
    assert (b.charged_s, b.contention_s) == pytest.approx((25.0, 15.0))


def test_deadline_at_tracks_rates_and_is_inf_when_not_charging() -> None:
    engine = ChargeMeter()
    c = _clock()
    assert c.deadline_at(0.0) == math.inf  # not dispatched
    c.start_dispatched(engine, FREE, 0.0)
    assert c.deadline_at(0.0) == pytest.approx(100.0)
    engine.add_large_prefill(10.0)
    assert c.deadline_at(20.0) == math.inf and not c.is_charging()
    engine.remove_large_prefill(30.0)
    assert c.deadline_at(30.0) == pytest.approx(120.0)


def test_stall_window_uses_virtual_time_and_restarts_on_resume() -> None:
    engine = ChargeMeter()
    c = _clock()
    c.start_dispatched(engine, FREE, 0.0)
    c.note_progress(5.0)
    assert c.stall_v() == pytest.approx(engine.value(FREE, 5.0) + 10.0)
    engine.set_paused(6.0, True)
    engine.set_paused(50.0, False)  # resume: the window starts again
    assert c.stall_v() == pytest.approx(engine.value(FREE, 50.0) + 10.0)
    assert c.stall_v(allowance_s=3.0) == pytest.approx(engine.value(FREE, 50.0) + 13.0)


def test_stints_accumulate_across_redispatch_and_finish_freezes() -> None:
    pool, e1, e2 = ChargeMeter(), ChargeMeter(), ChargeMeter()
    c = _clock()
    c.start_queued(pool, 0.0)
    c.start_dispatched(e1, FREE, 5.0)
    c.note_progress(8.0)
    c.start_queued(pool, 15.0)  # re-queued after 10 s on e1
    assert c.queue_v(100.0) == pytest.approx(pool.value(FREE, 15.0) + 95.0)
    c.start_dispatched(e2, FREE, 17.0)
    c.finish(27.0)
    b = c.breakdown(1000.0, attempts=2, engine_id="e2", tokens=3)
    assert (b.wall_s, b.queue_s, b.dispatched_s, b.charged_s, b.stall_s) == pytest.approx(
        (27.0, 7.0, 20.0, 20.0, 10.0)
    )
    assert c.charged_s(1000.0) == pytest.approx(20.0)
    assert c.queue_s(1000.0) == pytest.approx(7.0)


def test_switch_class_needs_a_dispatched_stint() -> None:
    with pytest.raises(ValueError):
        _clock().switch_class(FREE, 1.0)


def test_readings_outside_their_stint() -> None:
    pool, engine = ChargeMeter(), ChargeMeter()
    c = _clock()
    assert (c.charged_s(5.0), c.queue_s(5.0), c.is_dispatched, c.is_charging()) == (0.0, 0.0, False, False)
    c.start_queued(pool, 0.0)
    assert c.charged_s(5.0) == 0.0 and c.queue_s(5.0) == pytest.approx(5.0)
    c.start_dispatched(engine, FREE, 5.0)
    assert c.queue_s(9.0) == pytest.approx(5.0) and c.charged_s(9.0) == pytest.approx(4.0) and c.is_dispatched
    assert "dispatched" in repr(c) and "free" in repr(engine)
