"""Endings: no engine, queue full, queue timeout, wall cap, client grace, late events, no leaks, and an engine
handed over drained."""

from __future__ import annotations

import math

import pytest

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail, FailReason
from rolloutgate.core.events import (
    ClientAttached,
    ClientDisconnected,
    ClockMode,
    EngineDraining,
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    EngineVersionLag,
    GateClosed,
    GateOpened,
    ProgressReported,
    UpstreamFailed,
    UpstreamFinished,
)
from tests.core.helpers import Harness, of, reference


def test_no_engine_fails_queued_after_grace_and_new_ones_at_once() -> None:
    h = Harness(reference(no_engine_grace_s=30.0, no_engine_retry_after_s=5.0))
    h.arrive("a")
    h.advance(29.0)
    h.arrive("b")
    assert h.commands(Fail) == []
    out = h.advance(1.0)
    assert [(f.request_id, f.reason, f.retry_after_s) for f in of(out, Fail)] == [
        ("a", FailReason.NO_ENGINE, 5.0),
        ("b", FailReason.NO_ENGINE, 5.0),
    ]
    [fail] = of(h.arrive("c"), Fail)
    assert fail.reason is FailReason.NO_ENGINE and fail.retry_after_s == 5.0
    h.engines(e1=1)
    assert [d.request_id for d in of(h.arrive("d"), Dispatch)] == ["d"]


def test_no_engine_grace_restarts_when_the_last_engine_goes_unhealthy() -> None:
    h = Harness(reference(no_engine_grace_s=10.0))
    h.engines(e1=1)
    h.arrive("a")
    h.send(
        UpstreamFailed(request_id="a", reason="refused", engine_unreachable=True)
    )  # e1 unhealthy, a re-queued
    h.advance(9.0)
    assert h.commands(Fail) == []
    h.send(EngineHealthChecked(engine_id="e1", healthy=True))  # back in time: a runs
    assert h.commands(Dispatch, "a")[-1].attempt == 2
    h.send(EngineHealthChecked(engine_id="e1", healthy=False))
    h.send(UpstreamFailed(request_id="a", reason="refused"))
    out = h.advance(10.0)
    assert [f.reason for f in of(out, Fail)] == [FailReason.NO_ENGINE]
    assert h.gw.stats().live_requests == 0


def test_requeue_while_failing_fast_fails_at_once() -> None:
    h = Harness(reference(no_engine_grace_s=10.0))
    h.engines(e1=2)
    h.arrive("a")
    h.arrive("b")
    h.send(EngineHealthChecked(engine_id="e1", healthy=False))  # both keep running there
    h.advance(10.0, {"a": 1.0, "b": 1.0})
    assert h.commands(Fail) == []  # nothing was queued
    out = h.send(UpstreamFailed(request_id="a", reason="reset"))  # retryable, but there is nowhere to go
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.NO_ENGINE and h.gw.stats().live_requests == 1
    h.send(EngineJoined(engine_id="e2", capacity=1, healthy=False))
    assert of(h.send(UpstreamFinished(request_id="b")), Complete)


def test_queue_full() -> None:
    h = Harness(reference(max_queue=2, retry_after_s=2.0))
    h.engines(e1=1)
    h.arrive("running")
    h.arrive("q1")
    h.arrive("q2")
    [fail] = of(h.arrive("q3"), Fail)
    assert (fail.reason, fail.retry_after_s, fail.timing.wall_s) == (FailReason.QUEUE_FULL, 2.0, 0.0)
    assert h.gw.stats().live_requests == 3


def test_queue_timeout_counts_only_open_gate_time() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("running")
    h.arrive("q", queue_timeout_s=20.0)
    h.advance(10.0, {"running": 1.0})
    h.send(GateClosed())
    h.advance(100.0, {"running": 1.0})  # paused, not queue time
    h.send(GateOpened())
    out = h.advance(10.0, {"running": 1.0})
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.QUEUE_TIMEOUT and fail.retry_after_s == 1.0
    assert (fail.timing.queue_s, fail.timing.paused_s) == pytest.approx((20.0, 100.0))
    assert of(out, Abort) == []


def test_max_wall_aborts_if_dispatched_and_fails() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a", max_wall_s=50.0)
    h.arrive("b", max_wall_s=30.0)
    out = h.advance(50.0, {"a": 1.0})
    assert {f.request_id: f.reason for f in of(out, Fail)} == {
        "a": FailReason.MAX_WALL,
        "b": FailReason.MAX_WALL,
    }
    assert [(x.request_id, x.engine_id, x.reason) for x in of(out, Abort)] == [
        ("a", "e1", AbortReason.MAX_WALL)
    ]


def test_timeout_verdict_aborts_on_the_right_engine_with_the_breakdown() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("x")
    h.arrive("a", timeout_s=100.0)
    out = h.advance(150.0, {"a": 1.0, "x": 1.0})
    assert of(out, Abort) == [Abort(request_id="a", engine_id="e2", reason=AbortReason.TIMEOUT)]
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.TIMEOUT and fail.timing.charged_s == pytest.approx(100.0)
    assert fail.timing.engine_id == "e2" and fail.timing.tokens == 99
    assert "charged=100.000" in fail.timing.header_value()


def test_retry_grace_forgets_after_expiry_and_attach_cancels() -> None:
    h = Harness(reference(retry_grace_s=10.0))
    h.engines(e1=1)
    h.arrive("a")
    h.arrive("q")
    h.send(ClientDisconnected(request_id="a"))
    h.advance(9.0)
    h.send(ClientAttached(request_id="a"))  # a retry attached in time
    h.advance(20.0)
    assert h.commands(Abort) == []
    h.send(ClientDisconnected(request_id="a"))
    h.send(ClientDisconnected(request_id="q"))  # queued: dropped without an abort
    out = h.advance(10.0)
    assert of(out, Abort) == [Abort(request_id="a", engine_id="e1", reason=AbortReason.CLIENT_GONE)]
    assert of(out, Fail) == [] and of(out, Complete) == []  # nobody to answer
    stats = h.gw.stats()
    assert (stats.client_gone, stats.live_requests, stats.in_flight_total) == (2, 0, 0)


def test_zero_grace_aborts_at_once_and_wallclock_ignores_disconnects() -> None:
    h = Harness(reference(retry_grace_s=0.0))
    h.engines(e1=1)
    h.arrive("a")
    assert of(h.send(ClientDisconnected(request_id="a")), Abort)[0].reason is AbortReason.CLIENT_GONE
    w = Harness(reference(clock_mode=ClockMode.WALLCLOCK, retry_grace_s=0.0))
    w.engines(e1=1)
    w.arrive("a")
    assert w.send(ClientDisconnected(request_id="a")) == []
    w.advance(100.0)
    assert w.gw.stats().live_requests == 1


def test_late_and_unknown_events_are_ignored() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a")
    h.finish("a")
    for event in (
        ProgressReported(request_id="a"),
        UpstreamFinished(request_id="a"),
        UpstreamFailed(request_id="a", reason="late"),
        ClientDisconnected(request_id="a"),
        ClientAttached(request_id="a"),
        ProgressReported(request_id="never"),
        EngineHealthChecked(engine_id="never", healthy=True),
        EngineLeft(engine_id="never"),
    ):
        assert h.send(event) == []
    h.arrive("b")  # e1
    h.send(UpstreamFailed(request_id="b", reason="reset"))  # re-dispatched to e2 as attempt 2
    assert h.send(ProgressReported(request_id="b", attempt=1)) == []  # the old attempt's late token
    assert h.send(UpstreamFinished(request_id="b", attempt=1)) == []
    assert h.gw.timing("b", h.now).tokens == 0
    assert of(h.send(UpstreamFinished(request_id="b", attempt=2)), Complete)


def test_duplicate_live_request_id_raises() -> None:
    h = Harness()
    h.arrive("a")
    with pytest.raises(ValueError):
        h.arrive("a")


def test_no_state_leaks_after_a_busy_run() -> None:
    h = Harness(reference(retry_grace_s=1.0))
    h.engines(e1=2, e2=2)
    for i in range(40):
        h.arrive(
            f"r{i}",
            routing_key=f"s{i % 5}",
            prompt_tokens=5000 * (i % 3),
            queue_timeout_s=50.0,
            max_wall_s=80.0,
        )
    h.send(ClientDisconnected(request_id="r39"))
    for step in range(60):
        requests = h.gw.inspect().requests
        running = [rid for rid in list(h.engine_of) if rid in requests and requests[rid].engine]
        h.advance(1.0, dict.fromkeys(running, 0.5))
        if running and step % 2 == 0:
            h.finish(running[0])
    h.advance(200.0)
    stats = h.gw.stats()
    assert (stats.live_requests, stats.queue_depth, stats.in_flight_total, stats.pending_timers) == (
        0,
        0,
        0,
        0,
    )
    assert all(e.in_flight == 0 and e.prefill_tokens == 0 and e.large_prefills == 0 for e in stats.engines)
    ended = {c.request_id for c in h.commands(Complete)} | {c.request_id for c in h.commands(Fail)}
    assert len(ended) + stats.client_gone == 40
    assert h.gw.next_deadline() == math.inf


def test_stats_and_repr() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    h.arrive("b")
    assert repr(h.gw) == "<Gateway engine-clock [1 queued, 1 in flight on 1/1 engines, gate open]>"
    h.send(GateClosed())
    assert "gate closed (drain)" in repr(h.gw)
    stats = h.gw.stats()
    assert stats.gate == "drain" and stats.in_flight == {"e1": 1} and stats.arrived == 2
    assert stats.timeouts == 0 and stats.clock_mode == "engine"


def test_a_draining_engine_takes_no_new_work_and_its_running_calls_finish_there() -> None:
    """A hand-over to another gateway (fleet/replica.py): nothing aborted, nothing new placed there."""
    h = Harness()
    h.engines(e1=4)
    h.arrive("running")
    assert h.engine_of["running"] == "e1"
    assert h.send(EngineDraining(engine_id="e1")) == []  # nothing aborted or re-queued
    h.arrive("new")
    assert "new" not in h.engine_of  # waits: its only engine drains
    h.engines(e2=4)
    assert h.engine_of["new"] == "e2"
    h.progress("running", 50)
    assert of(h.finish("running"), Complete) and h.attempt_of["running"] == 1
    assert h.gw.in_flight_on("e1") == 0 and h.gw.in_flight_on("e2") == 1 and h.gw.in_flight_on("gone") == 0
    assert h.commands(Abort) == []
    h.send(EngineDraining(engine_id="e1", draining=False))  # given back: it takes work again
    h.arrive("third")
    assert h.engine_of["third"] == "e1"
    assert h.send(EngineDraining(engine_id="never")) == []


def test_a_request_starts_only_where_its_version_policy_allows_the_weights() -> None:
    """EngineVersionLag: an engine behind the pool's newest weights takes no request whose policy allows less
    (RequestArrived.max_version_lag); what runs there goes on; a request with no policy, or pinned there, may
    start there; once it catches up it takes them all again."""
    h = Harness()
    h.engines(e1=4, e2=4)
    h.arrive("running", max_version_lag=0)
    on = h.engine_of["running"]
    other = "e2" if on == "e1" else "e1"
    assert h.send(EngineVersionLag(engine_id=on, lag=1)) == []  # nothing aborted or re-queued
    for name in ("a", "b", "c"):
        h.arrive(name, max_version_lag=0)
        assert h.engine_of[name] == other
    h.arrive("stale-ok", max_version_lag=1)  # the least loaded now, and its lag is allowed
    assert h.engine_of["stale-ok"] == on
    h.arrive("pinned", max_version_lag=0, pinned_engine=on)
    assert h.engine_of["pinned"] == on
    h.arrive("waits", max_version_lag=0)  # e-other has room: it goes there, never to the lagging engine
    assert h.engine_of["waits"] == other
    h.progress("running", 50)
    assert of(h.finish("running"), Complete) and h.attempt_of["running"] == 1
    assert h.commands(Abort) == []
    h.send(EngineVersionLag(engine_id=on, lag=0))
    h.arrive("d", max_version_lag=0)
    assert h.engine_of["d"] == on  # the least loaded again
    assert h.send(EngineVersionLag(engine_id="never", lag=2)) == []


def test_a_waiting_request_never_starts_on_weights_its_policy_forbids() -> None:
    """Every slot of the current engine busy: a latest-only request waits for it rather than take the free
    slot of the lagging engine; a request without a policy takes that slot."""
    h = Harness()
    h.engines(e1=1, e2=1)
    h.send(EngineVersionLag(engine_id="e2", lag=1))
    h.arrive("first", max_version_lag=0)
    assert h.engine_of["first"] == "e1"
    h.arrive("strict", max_version_lag=0)
    assert "strict" not in h.engine_of  # e2 is free, but behind
    h.arrive("any")
    assert h.engine_of["any"] == "e2"
    h.progress("first", 5)
    h.finish("first")
    assert h.engine_of["strict"] == "e1"
