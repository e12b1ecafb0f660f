"""The weight-update gate: nothing dispatched and nobody charged while closed; abort mode re-queues in order."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail, FailReason, MarkEngine
from rolloutgate.core.events import (
    ClockMode,
    EnginePaused,
    EngineResumed,
    GateClosed,
    GateOpened,
    PauseMode,
    QueueAborted,
)
from tests.core.helpers import Harness, of, reference


def test_closed_gate_dispatches_nothing_and_open_dispatches_what_fits() -> None:
    h = Harness()
    h.engines(e1=2)
    h.send(GateClosed(mode=PauseMode.DRAIN))
    for rid in ("a", "b", "c"):
        h.arrive(rid)
    assert h.commands(Dispatch) == []
    h.advance(100.0)
    out = h.send(GateOpened())
    assert [d.request_id for d in of(out, Dispatch)] == ["a", "b"]
    assert h.send(GateOpened()) == []  # already open


def test_abort_mode_requeues_in_flight_at_the_front_in_original_order() -> None:
    h = Harness()
    h.engines(e1=2, e2=1)
    for rid in ("a", "b", "c", "d"):
        h.arrive(rid)  # a, c on e1; b on e2; d waits
    h.advance(10.0, {"a": 1.0, "b": 1.0, "c": 1.0})
    out = h.send(GateClosed(mode=PauseMode.ABORT))
    assert [(x.request_id, x.engine_id, x.reason) for x in of(out, Abort)] == [
        ("a", "e1", AbortReason.REQUEUE),
        ("b", "e2", AbortReason.REQUEUE),
        ("c", "e1", AbortReason.REQUEUE),
    ]
    assert h.gw.stats().in_flight_total == 0 and h.gw.stats().queue_depth == 4
    h.advance(30.0)
    h.arrive("e")
    out = h.send(GateOpened())
    assert [(d.request_id, d.attempt) for d in of(out, Dispatch)] == [("a", 2), ("b", 2), ("c", 2)]
    h.advance(5.0, {"a": 1.0})
    h.finish("a")
    [done] = h.commands(Complete, "a")
    # 10 s charged on the first attempt + 5 s on the second; the gate's 30 s are paused, not queue
    assert (done.timing.charged_s, done.timing.paused_s, done.timing.queue_s) == pytest.approx(
        (15.0, 30.0, 0.0)
    )
    assert h.commands(Dispatch)[-1].request_id == "d"  # then the older of the waiting fresh ones


def test_in_place_mode_keeps_work_on_engines_and_suspends_liveness() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a", timeout_s=60.0, stall_timeout_s=10.0)
    h.advance(30.0, {"a": 1.0})
    out = h.send(GateClosed(mode=PauseMode.IN_PLACE))
    assert out == []
    h.advance(500.0)  # engines paused in place by the edge: no progress, no hang, no charge
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == []
    h.send(GateOpened())
    h.advance(8.0)  # stall window restarts at the opening
    assert h.commands(MarkEngine) == []
    h.advance(20.0, {"a": 1.0})
    h.finish("a")
    [done] = h.commands(Complete, "a")
    assert done.timing.charged_s == pytest.approx(58.0) and done.timing.paused_s == pytest.approx(500.0)


def test_drain_mode_keeps_engine_liveness_running() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a", stall_timeout_s=10.0)
    h.send(GateClosed(mode=PauseMode.DRAIN))
    out = h.advance(10.0)  # a hung engine would block the drain: it is still caught
    assert [m.state for m in of(out, MarkEngine)] == ["quarantined"]
    assert [x.reason for x in of(out, Abort)] == [AbortReason.ENGINE_HUNG]
    assert of(out, Dispatch) == [] and h.gw.stats().queue_depth == 1  # re-queued, runs after the gate opens
    assert [d.engine_id for d in of(h.send(GateOpened()), Dispatch)] == ["e2"]


def test_closing_again_in_abort_mode_aborts_what_drain_left_running() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    h.send(GateClosed(mode=PauseMode.DRAIN))
    out = h.send(GateClosed(mode=PauseMode.ABORT))
    assert [x.reason for x in of(out, Abort)] == [AbortReason.REQUEUE]


def test_paused_engine_gets_no_work_and_resume_dispatches() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.send(EnginePaused(engine_id="e1"))
    h.arrive("a")
    h.arrive("b")
    assert [(d.request_id, d.engine_id) for d in h.commands(Dispatch)] == [("a", "e2")]
    out = h.send(EngineResumed(engine_id="e1"))
    assert [(d.request_id, d.engine_id) for d in of(out, Dispatch)] == [("b", "e1")]
    assert h.send(EngineResumed(engine_id="e1")) == [] and h.send(EnginePaused(engine_id="zz")) == []


def test_engine_joining_while_gate_closed_starts_paused() -> None:
    h = Harness()
    h.send(GateClosed())
    h.engines(e1=1)
    h.arrive("a")
    h.advance(20.0)
    h.send(GateOpened())
    h.advance(5.0, {"a": 1.0})
    h.finish("a")
    [done] = h.commands(Complete, "a")
    assert (done.timing.charged_s, done.timing.paused_s) == pytest.approx((5.0, 20.0))


def test_gate_works_the_same_in_wallclock_mode() -> None:
    h = Harness(reference(clock_mode=ClockMode.WALLCLOCK))
    h.engines(e1=1)
    h.arrive("a")
    out = h.send(GateClosed(mode=PauseMode.ABORT))
    assert [x.reason for x in of(out, Abort)] == [AbortReason.REQUEUE]
    h.arrive("b")
    assert len(h.commands(Dispatch)) == 1
    assert len(of(h.send(GateOpened()), Dispatch)) == 2


def test_an_aborted_queue_ends_what_waits_and_leaves_what_runs() -> None:
    h = Harness()
    h.engines(e1=1)
    for rid in ("a", "b", "c"):
        h.arrive(rid)  # a runs; b, c wait
    h.advance(5.0, {"a": 1.0})
    out = h.send(QueueAborted())
    assert [(f.request_id, f.reason) for f in of(out, Fail)] == [
        ("b", FailReason.ABORTED),
        ("c", FailReason.ABORTED),
    ]
    assert of(out, Abort) == []  # the engine answers what it runs (the edge sends it the abort)
    assert h.gw.stats().queue_depth == 0 and h.gw.stats().in_flight_total == 1
    h.finish("a")
    assert [c.request_id for c in h.commands(Complete)] == ["a"]
    h.arrive("d")
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "d"  # the gateway goes on serving


def test_queue_aborted_with_ids_ends_only_the_named_waiting_requests() -> None:
    h = Harness()
    h.engines(e1=1)
    for rid in ("a", "b", "c", "d"):
        h.arrive(rid)  # a runs; b, c, d wait
    out = h.send(QueueAborted(request_ids=frozenset({"a", "c"})))
    # `a` runs on its engine (the edge aborts it there); `c` waited and ends here
    assert [(f.request_id, f.reason) for f in of(out, Fail)] == [("c", FailReason.ABORTED)]
    assert h.gw.stats().queue_depth == 2
    h.finish("a")
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "b"
