"""Stalls: slow progress is never killed, a frozen engine is caught within stall_timeout, a request stuck alone
is retried once elsewhere, and a long prefill is not mistaken for a hang."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import (
    Abort,
    AbortReason,
    CheckEngine,
    Complete,
    Dispatch,
    Fail,
    FailReason,
    MarkEngine,
)
from rolloutgate.core.events import EngineHealthChecked, EnginePaused, EngineResumed, ProgressReported
from tests.core.helpers import Harness, of, reference


def test_slow_but_progressing_request_is_never_killed() -> None:
    h = Harness()
    h.engines(e1=2)
    h.arrive("a", timeout_s=600.0, stall_timeout_s=10.0)
    h.advance(590.0, {"a": 9.9})  # one token every 9.9 s, for almost 10 minutes
    h.finish("a")
    assert h.commands(Abort) == [] and h.commands(Fail) == [] and h.commands(MarkEngine) == []


def test_frozen_engine_is_detected_within_stall_timeout_and_work_moves() -> None:
    h = Harness()
    h.engines(e1=2, e2=2)
    h.arrive("a", stall_timeout_s=30.0)
    h.arrive("b", stall_timeout_s=30.0)
    h.arrive("c", stall_timeout_s=30.0)  # least outstanding: a, c on e1 and b on e2
    assert (h.engine_of["a"], h.engine_of["b"], h.engine_of["c"]) == ("e1", "e2", "e1")
    h.advance(50.0, {"a": 1.0, "b": 1.0, "c": 1.0})
    frozen_at = h.now
    out = h.advance(40.0, {"b": 1.0})  # e1 freezes: no progress from a or c
    [mark] = of(out, MarkEngine)
    detected_at = next(t for t, c in h.log if c is mark)
    assert mark.engine_id == "e1" and mark.state == "quarantined"
    assert detected_at - frozen_at == pytest.approx(30.0)  # within stall_timeout (+0%)
    assert [(a.request_id, a.engine_id, a.reason) for a in of(out, Abort)] == [
        ("a", "e1", AbortReason.ENGINE_HUNG),
        ("c", "e1", AbortReason.ENGINE_HUNG),
    ]
    assert [(d.request_id, d.engine_id, d.attempt) for d in of(out, Dispatch)] == [("a", "e2", 2)]
    assert h.gw.stats().queue_depth == 1  # c waits for a slot: e1 gets nothing while quarantined
    h.finish("b")
    assert h.engine_of["c"] == "e2"
    out = h.send(EngineHealthChecked(engine_id="e1", healthy=False))
    assert out == [] and h.gw.stats().engines[0].state == "quarantined"
    out = h.send(EngineHealthChecked(engine_id="e1", healthy=True))
    assert of(out, MarkEngine) == [MarkEngine(engine_id="e1", state="healthy", detail="health check passed")]


def test_engine_stall_window_starts_when_it_became_busy() -> None:
    h = Harness()
    h.engines(e1=1)
    h.advance(1000.0)  # idle for a long time
    h.arrive("a", stall_timeout_s=20.0)
    h.advance(19.9)
    assert h.commands(MarkEngine) == []
    h.advance(0.1)
    assert [m.state for m in h.commands(MarkEngine)] == ["quarantined"]


def test_a_long_prefill_is_not_a_hang_but_a_frozen_prefill_is_caught() -> None:
    h = Harness()
    h.engines(e1=4)
    h.arrive("a", stall_timeout_s=60.0)
    h.advance(10.0, {"a": 1.0})
    h.arrive("big", prompt_tokens=100_000, stall_timeout_s=60.0)
    h.advance(75.0)  # prefill-first: the engine shows nothing at all for 75 s (> stall_timeout)
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == []
    h.progress("big")
    h.advance(5.0, {"a": 1.0, "big": 1.0})
    # now an engine that freezes during a prefill is still caught: window = 60 s + 100K / 2000 tok/s = 110 s
    h.arrive("big2", prompt_tokens=100_000, stall_timeout_s=60.0)
    frozen_at = h.now
    h.advance(200.0)
    [mark] = h.commands(MarkEngine)
    assert next(t for t, c in h.log if c is mark) - frozen_at == pytest.approx(110.0)


def test_request_stuck_alone_is_retried_once_elsewhere_then_fails() -> None:
    h = Harness()
    h.engines(e1=2, e2=2)
    h.arrive("a", stall_timeout_s=30.0)
    h.arrive("b")
    h.arrive("c")
    assert (h.engine_of["a"], h.engine_of["b"], h.engine_of["c"]) == ("e1", "e2", "e1")
    h.advance(20.0, {"a": 1.0, "b": 1.0, "c": 1.0})
    out = h.advance(40.0, {"b": 1.0, "c": 1.0})  # a stops; c on the same engine keeps going
    assert [(x.request_id, x.engine_id, x.reason) for x in of(out, Abort)] == [("a", "e1", AbortReason.STUCK)]
    [d] = of(out, Dispatch)
    assert (d.request_id, d.engine_id, d.attempt) == ("a", "e2", 2)
    assert h.commands(MarkEngine) == []  # the engine is fine
    out = h.advance(40.0, {"b": 1.0, "c": 1.0})  # stuck again on e2 while b progresses there
    assert [(x.request_id, x.engine_id, x.reason) for x in of(out, Abort)] == [("a", "e2", AbortReason.STUCK)]
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.STALL and fail.timing.attempts == 2


def test_stuck_is_not_judged_while_the_engine_prefills_others() -> None:
    h = Harness()
    h.engines(e1=4)
    h.arrive("a", stall_timeout_s=30.0)
    h.arrive("c")
    h.advance(20.0, {"a": 1.0, "c": 1.0})
    last_a = h.now
    h.advance(5.0, {"c": 1.0})  # a silent for 5 s of charged time
    h.arrive("big", prompt_tokens=100_000)
    h.advance(35.0, {"c": 1.0})  # big prefills: contention, a's stall window is frozen
    assert h.commands(Abort) == []
    h.progress("big")
    out = h.advance(30.0, {"c": 1.0, "big": 1.0})
    [abort] = of(out, Abort)
    stuck_at = next(t for t, c in h.log if c is abort)
    assert abort.reason is AbortReason.STUCK and stuck_at - last_a == pytest.approx(30.0 + 35.0)


def test_a_lone_silent_request_is_an_engine_hang_not_stuck() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a", stall_timeout_s=30.0)
    h.advance(10.0, {"a": 1.0})
    out = h.advance(30.0)
    assert [m.state for m in of(out, MarkEngine)] == ["quarantined"]
    assert [x.reason for x in of(out, Abort)] == [AbortReason.ENGINE_HUNG]
    assert h.engine_of["a"] == "e2"


def test_hung_engine_with_attempts_exhausted_fails_the_request() -> None:
    h = Harness(reference(max_attempts=1))
    h.engines(e1=1, e2=1)
    h.arrive("a", stall_timeout_s=10.0)
    out = h.advance(10.0)
    assert [x.reason for x in of(out, Abort)] == [AbortReason.ENGINE_HUNG]
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.ATTEMPTS_EXHAUSTED


def test_pool_level_engine_stall_timeout() -> None:
    h = Harness(reference(engine_stall_timeout_s=15.0))
    h.engines(e1=1)
    h.arrive("a", stall_timeout_s=60.0)
    out = h.advance(15.0)
    assert [m.state for m in of(out, MarkEngine)] == ["quarantined"]


def test_requests_pinned_to_a_hung_engine_fail() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a", pinned_engine="e1", stall_timeout_s=10.0)
    h.arrive("b", pinned_engine="e1")
    out = h.advance(10.0)
    assert [x.reason for x in of(out, Abort)] == [AbortReason.ENGINE_HUNG]
    assert {f.request_id: f.reason for f in of(out, Fail)} == {
        "a": FailReason.NO_ENGINE,
        "b": FailReason.NO_ENGINE,
    }
    assert h.gw.stats().live_requests == 0


def test_an_attempt_lost_to_a_hung_engine_is_forgiven_not_charged() -> None:
    """The replay's reproduction: 7.7 s of work, its engine freezes 6 s in; moved after stall_timeout, it must
    get its whole budget (12 s) on the new engine instead of carrying 8 s of the lost attempt."""
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a", timeout_s=12.0, stall_timeout_s=2.0)
    assert h.engine_of["a"] == "e1"
    h.advance(6.0, {"a": 0.1})
    h.advance(2.0)  # e1 froze: quarantined after 2 s, `a` moves to e2
    assert (h.engine_of["a"], h.attempt_of["a"]) == ("e2", 2)
    h.advance(7.7, {"a": 0.1})  # the whole generation again, on e2
    h.finish("a")
    [complete] = h.ended("a")
    assert isinstance(complete, Complete)
    assert complete.timing.forgiven_s == pytest.approx(8.0, abs=0.15)  # last token 5.9-6.0 s, +2 s stall
    assert complete.timing.charged_s == pytest.approx(7.7, abs=0.15)  # only the attempt that answered
    assert complete.timing.attempts == 2


def test_stats_say_when_a_busy_engine_counts_as_hung_and_what_its_requests_generated() -> None:
    """What `rolloutgate top` reads (server/pool.py describe_live): an engine's silence and its deadline, only
    while it is judged; the output its requests' own streams reported, engine-level shares left out."""
    h = Harness()
    h.engines(e1=2)
    assert h.gw.stats().engines[0].hung_at == float("inf")  # no work: not judged
    h.arrive("a", stall_timeout_s=20.0)
    h.advance(5.0)
    h.progress("a", tokens=7)
    h.send(ProgressReported(request_id="a", tokens=100, engine_level=True))
    h.advance(3.0)
    [engine] = h.gw.stats().engines
    assert engine.silent_since_at == pytest.approx(h.now - 3.0)
    assert engine.hung_at == pytest.approx(engine.silent_since_at + 20.0)
    assert engine.generated_tokens == 7
    h.finish("a")
    assert h.gw.stats().engines[0].hung_at == float("inf")


def test_a_silent_engine_is_asked_whether_it_is_paused_before_it_is_judged_hung() -> None:
    """A trainer paused e1 itself and the health loop has not read it yet: hang_check_s before the end of its
    stall window the core asks (CheckEngine), the edge reads the pause within hang_check_s, and nothing is
    quarantined."""
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2)
    h.arrive("a", stall_timeout_s=10.0)
    h.advance(5.0, {"a": 1.0})
    h.advance(7.9)  # the pause began with the last token
    assert h.commands(CheckEngine) == []
    h.advance(0.1)  # 2 s before the window ends
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")] and h.commands(MarkEngine) == []
    h.advance(1.9)
    h.send(EnginePaused(engine_id="e1"))
    h.advance(600.0)  # paused: no verdict, however long
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == []
    h.send(EngineResumed(engine_id="e1"))
    h.advance(3.0, {"a": 1.0})
    h.finish("a")
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")] and h.commands(Fail) == []


def test_an_engine_that_stays_silent_after_its_check_is_quarantined_once_per_silence() -> None:
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2, e2=2)
    busy_at = h.now
    h.arrive("a", stall_timeout_s=10.0)
    h.advance(7.9)
    assert h.commands(CheckEngine) == []
    h.advance(1.9)  # asked at 8.0
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")] and h.commands(MarkEngine) == []
    out = h.advance(0.2)  # judged when its window ends: the check cost the verdict no time
    [mark] = of(out, MarkEngine)
    assert mark.state == "quarantined" and next(t for t, c in h.log if c is mark) == pytest.approx(
        busy_at + 10.0
    )
    assert [(a.request_id, a.reason) for a in of(out, Abort)] == [("a", AbortReason.ENGINE_HUNG)]
    assert h.engine_of["a"] == "e2"
    h.advance(9.0)  # a new silence on e2: its own check (at 18), then its own verdict (at 20)
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1"), CheckEngine(engine_id="e2")]


def test_progress_during_the_check_clears_the_suspicion() -> None:
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2)
    h.arrive("a", stall_timeout_s=10.0)
    h.advance(8.0)  # asked at 8.0
    h.advance(1.0)
    h.progress("a")  # slow, not hung
    h.advance(7.9)
    assert h.commands(MarkEngine) == [] and h.commands(CheckEngine) == [CheckEngine(engine_id="e1")]
    h.advance(0.1)  # the next silence is due for its check: asked again
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")] * 2 and h.commands(MarkEngine) == []


def two_on_e1_one_on_e2(h: Harness) -> Harness:
    """`a` and `b` on e1, `x` on e2, each with a 3 s stall timeout."""
    h.engines(e1=4, e2=4)
    h.arrive("a", stall_timeout_s=3.0)
    h.arrive("x", stall_timeout_s=3.0)
    h.arrive("b", stall_timeout_s=3.0)
    assert (h.engine_of["a"], h.engine_of["b"], h.engine_of["x"]) == ("e1", "e1", "e2")
    return h


def test_a_stream_silent_with_its_engine_is_not_stuck_alone_when_the_pause_is_read_late() -> None:
    """CI's race, on a fake clock: a trainer pauses e1 just after its last token for `a` and a last engine-level
    reading for `b` (a non-streamed call) that lands 0.2 s later; the health loop reads the pause only 5 s in,
    past a's 3 s stall window. e1 went silent with `a`: `a` is not stuck alone, nothing is aborted, and the
    check asked of the silent engine is what catches the pause."""
    h = two_on_e1_one_on_e2(Harness(reference(hang_check_s=2.0)))
    h.advance(5.0, {"a": 0.05, "b": 0.05, "x": 0.05})
    h.advance(0.2, {"x": 0.05})
    h.send(ProgressReported(request_id="b", tokens=10, engine_level=True))  # the engine's counter, read late
    h.advance(1.1, {"x": 0.05})  # paused: nothing from e1; asked at 6.2, 2 s before its window ends
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")]
    h.advance(1.5, {"x": 0.05})  # the edge's answer, within hang_check_s
    h.send(EnginePaused(engine_id="e1"))
    h.advance(10.0, {"x": 0.05})
    assert h.commands(Abort) == [] and h.commands(MarkEngine) == [] and h.commands(Fail) == []
    h.send(EngineResumed(engine_id="e1"))
    h.advance(2.0, {"a": 0.05, "b": 0.05, "x": 0.05})
    assert h.commands(Abort) == []


def test_a_request_stuck_while_its_engine_keeps_progressing_is_still_caught() -> None:
    h = two_on_e1_one_on_e2(Harness())
    h.advance(1.0, {"a": 0.05, "b": 0.05, "x": 0.05})
    last_a = h.now
    out = h.advance(4.0, {"b": 0.05, "x": 0.05})  # a alone gets nothing while b progresses on e1
    [abort] = of(out, Abort)
    stuck_at = next(t for t, c in h.log if c is abort)
    assert (abort.request_id, abort.reason) == ("a", AbortReason.STUCK)
    assert stuck_at - last_a == pytest.approx(3.0, abs=0.06)
