"""What is charged and what is not: queue, pauses and other requests' prefills never count against `timeout`."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail, FailReason
from rolloutgate.core.events import (
    ClockMode,
    EnginePaused,
    EngineResumed,
    GateClosed,
    GateOpened,
    PauseMode,
)
from tests.core.helpers import Harness, of, reference

WALLCLOCK = reference(clock_mode=ClockMode.WALLCLOCK)


def complete(h: Harness, rid: str) -> Complete:
    [c] = h.commands(Complete, rid)
    return c


def test_queue_time_is_not_charged() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    h.arrive("b", timeout_s=60.0)
    assert h.gw.stats().queue_depth == 1
    h.advance(100.0, {"a": 1.0})
    h.finish("a")
    assert h.engine_of["b"] == "e1"
    h.advance(50.0, {"b": 1.0})
    h.finish("b")
    t = complete(h, "b").timing
    assert (t.wall_s, t.queue_s, t.charged_s, t.paused_s) == pytest.approx((150.0, 100.0, 50.0, 0.0))
    assert h.commands(Fail) == []


def test_gate_pause_is_not_charged_while_queued_or_in_flight() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a", timeout_s=50.0)
    h.arrive("b")
    h.advance(10.0, {"a": 1.0})
    h.send(GateClosed(mode=PauseMode.DRAIN))
    h.advance(30.0, {"a": 1.0})  # a keeps streaming on the engine (drain), uncharged
    h.send(GateOpened())
    h.advance(35.0, {"a": 1.0})  # charged 45 s < 50 s although 75 s went by
    h.finish("a")
    ta = complete(h, "a").timing
    assert (ta.charged_s, ta.paused_s, ta.wall_s) == pytest.approx((45.0, 30.0, 75.0))
    h.advance(1.0, {"b": 0.5})
    h.finish("b")
    tb = complete(h, "b").timing
    # b waited 75 s: 30 of them with the gate closed count as paused, not as queue
    assert (tb.queue_s, tb.paused_s, tb.charged_s) == pytest.approx((45.0, 30.0, 1.0))


def test_the_same_run_without_the_gate_times_out() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a", timeout_s=50.0)
    h.advance(75.0, {"a": 1.0})
    [fail] = h.commands(Fail, "a")
    assert fail.reason is FailReason.TIMEOUT and fail.timing.charged_s == pytest.approx(50.0)
    assert h.commands(Abort, "a") == [Abort(request_id="a", engine_id="e1", reason=AbortReason.TIMEOUT)]


def test_engine_pause_is_not_charged_and_is_not_a_stall() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a", timeout_s=50.0, stall_timeout_s=10.0)
    h.advance(20.0, {"a": 1.0})
    h.send(EnginePaused(engine_id="e1"))
    h.advance(300.0)  # weight update: no progress, no charge, no hang
    h.send(EngineResumed(engine_id="e1"))
    h.advance(20.0, {"a": 1.0})
    h.finish("a")
    t = complete(h, "a").timing
    assert (t.charged_s, t.paused_s, t.dispatched_s) == pytest.approx((40.0, 300.0, 340.0))
    assert h.commands(Abort) == [] and h.gw.stats().quarantined == 0


def test_other_requests_large_prefill_is_contention_not_charge() -> None:
    h = Harness()
    h.engines(e1=4)
    h.arrive("a", timeout_s=600.0)
    h.advance(10.0, {"a": 1.0})
    h.arrive("big", prompt_tokens=100_000)
    h.advance(35.0, {"a": 5.0})  # a gets a trickle while big prefills
    h.progress("big")  # big's first token: its prefill is over
    h.advance(5.0, {"a": 1.0, "big": 1.0})
    h.finish("a")
    h.finish("big")
    ta, tb = complete(h, "a").timing, complete(h, "big").timing
    assert (ta.charged_s, ta.contention_s) == pytest.approx((15.0, 35.0))
    assert (tb.charged_s, tb.contention_s) == pytest.approx((40.0, 0.0))  # its own prefill is its work


def test_small_prefills_do_not_count_as_contention() -> None:
    h = Harness(reference(contention_min_prefill_tokens=4096))
    h.engines(e1=4)
    h.arrive("a")
    h.advance(10.0, {"a": 1.0})
    h.arrive("small", prompt_tokens=4095)
    h.advance(10.0, {"a": 1.0})
    h.finish("a")
    assert complete(h, "a").timing.contention_s == 0.0


def test_cached_session_prefix_is_not_a_large_prefill() -> None:
    h = Harness()
    h.engines(e1=4)
    h.arrive("t1", prompt_tokens=100_000, routing_key="s")
    h.advance(30.0, {"t1": 1.0})
    h.finish("t1")  # the engine now holds the session's prefix (+ output)
    h.arrive("a")
    h.advance(1.0, {"a": 1.0})
    h.arrive("t2", prompt_tokens=100_100, routing_key="s")  # only ~100 new tokens
    h.advance(10.0, {"a": 1.0})
    h.finish("a")
    assert complete(h, "a").timing.contention_s == 0.0
    assert h.gw.stats().engines[0].large_prefills == 0


def _incident(mode: ClockMode) -> Harness:
    """Request A: 60 s waiting for a slot, 460 s of its own decode, 3 x 30 s of other sessions' 100K prefills."""
    h = Harness(reference(clock_mode=mode))
    h.engines(e1=4)
    t0 = h.now
    fillers = [f"f{i}" for i in range(4)]
    for rid in fillers:
        h.arrive(rid)
    h.arrive("a", timeout_s=600.0, stall_timeout_s=60.0)  # engine mode: waits in the gateway queue
    streams = dict.fromkeys(fillers, 1.0)
    h.advance(60.0, streams)
    h.finish("f0")  # a starts on the engine now (in wallclock mode it sat in the engine's own queue)
    h.advance(40.0, {**streams, "a": 1.0})
    for rid in fillers[1:]:
        h.finish(rid)
    for start, session in ((260.0, "b"), (400.0, "c"), (550.0, "d")):
        h.advance(t0 + start - h.now, {"a": 1.0})
        h.arrive(session, prompt_tokens=100_000, routing_key=session)
        h.advance(30.0, {"a": 8.0})  # ~3-8 tok/s for a while the engine prefills 100K tokens
        h.progress(session)
        h.finish(session)
    h.advance(t0 + 610.0 - h.now, {"a": 1.0})
    if not h.ended("a"):
        h.finish("a")
    return h


def test_incident_request_completes_in_engine_mode() -> None:
    h = _incident(ClockMode.ENGINE)
    assert h.commands(Dispatch, "a")[0].engine_id == "e1"
    t = complete(h, "a").timing
    assert (t.wall_s, t.queue_s, t.contention_s, t.charged_s) == pytest.approx((610.0, 60.0, 90.0, 460.0))
    assert h.commands(Abort) == [] and h.commands(Fail) == []


def test_incident_request_times_out_in_wallclock_mode_without_abort() -> None:
    h = _incident(ClockMode.WALLCLOCK)
    [fail] = h.ended("a")
    assert isinstance(fail, Fail) and fail.reason is FailReason.TIMEOUT
    assert fail.timing.wall_s == pytest.approx(600.0)
    assert fail.timing.charged_s < 600.0  # it was progressing: the engine's own work was well within budget
    assert h.commands(Abort) == []  # the engine keeps generating an answer nobody will read


def test_wallclock_dispatches_at_once_and_counts_from_arrival() -> None:
    h = Harness(WALLCLOCK)
    h.engines(e1=1)
    for rid in ("a", "b", "c"):
        h.arrive(rid, timeout_s=30.0, stall_timeout_s=5.0)
    assert [d.engine_id for d in h.commands(Dispatch)] == ["e1"] * 3  # no admission limit
    h.advance(29.0)  # no progress at all: no stall or hung verdict in wallclock mode
    assert h.commands(Fail) == [] and h.commands(Abort) == []
    out = h.advance(1.0)
    assert sorted(f.request_id for f in of(out, Fail)) == ["a", "b", "c"]
    assert of(out, Abort) == []
    assert h.gw.stats().in_flight_total == 0 and h.gw.stats().live_requests == 0


def test_timing_is_live_and_unknown_requests_raise() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    h.advance(5.0, {"a": 1.0})
    t = h.gw.timing("a", h.now)
    assert (t.charged_s, t.attempts, t.engine_id, t.tokens) == (5.0, 1, "e1", 5)
    with pytest.raises(KeyError):
        h.gw.timing("nope", h.now)
