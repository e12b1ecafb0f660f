"""A pause nobody announced is never charged: the edge learns it late, the core counts it from the engine's last
progress (EnginePaused(unannounced=True); request_clock.py `ChargeMeter.backdate_pause`). ManualClock only."""

from __future__ import annotations

import pytest

from rolloutgate.core.charge_meter import HISTORY, ChargeClass, ChargeMeter
from rolloutgate.core.commands import Abort, Complete, Fail, MarkEngine
from rolloutgate.core.events import EnginePaused, EngineResumed, ProgressReported
from rolloutgate.core.request_clock import RequestClock
from tests.core.helpers import Harness, reference


def complete(h: Harness, request_id: str) -> Complete:
    (done,) = [c for c in h.ended(request_id) if isinstance(c, Complete)]
    return done


# --- the meter -------------------------------------------------------------------------------------------------


def test_backdating_moves_what_each_mode_took_since_then_to_paused() -> None:
    meter = ChargeMeter()
    meter.add_large_prefill(10.0)  # SOLO from 10
    meter.add_large_prefill(12.0)  # CONTENDED from 12
    meter.remove_large_prefill(15.0)  # SOLO again
    assert meter.backdate_pause(11.0, 20.0) == 11.0
    assert meter.value(ChargeClass.FREE, 20.0) == pytest.approx(10.0)
    assert meter.value(ChargeClass.SOLO, 20.0) == pytest.approx(1.0)
    assert meter.paused_value(20.0) == pytest.approx(9.0)  # 11..20, the contended 3 s included
    assert meter.paused_value(25.0) == pytest.approx(14.0)  # and it stays paused
    meter.set_paused(25.0, False)
    assert meter.value(ChargeClass.SOLO, 27.0) == pytest.approx(3.0)  # one large prefill still runs


def test_backdating_past_the_kept_history_forgives_from_the_oldest_change_kept() -> None:
    meter = ChargeMeter()
    for i in range(HISTORY):  # each a mode change: FREE <-> SOLO every second
        (meter.add_large_prefill if i % 2 == 0 else meter.remove_large_prefill)(float(i + 1))
    since = meter.backdate_pause(0.5, 100.0)
    assert since > 0.5  # less forgiven, never more
    assert meter.paused_value(100.0) == pytest.approx(100.0 - since)
    total = meter.value(ChargeClass.FREE, 100.0) + meter.value(ChargeClass.SOLO, 100.0)
    assert total + meter.paused_value(100.0) == pytest.approx(100.0)


def test_a_stint_begun_after_the_pause_began_was_paused_throughout() -> None:
    meter = ChargeMeter()
    early = RequestClock(arrived_at=0.0, timeout_s=600.0, stall_timeout_s=60.0)
    late = RequestClock(arrived_at=25.0, timeout_s=600.0, stall_timeout_s=60.0)
    early.start_dispatched(meter, ChargeClass.FREE, 0.0)
    early.note_progress(20.0)
    late.start_dispatched(meter, ChargeClass.FREE, 25.0)
    since = meter.backdate_pause(20.0, 40.0)
    early.rebase(since, 40.0)
    late.rebase(since, 40.0)
    assert early.charged_s(40.0) == pytest.approx(20.0)
    assert late.charged_s(40.0) == pytest.approx(0.0)
    meter.set_paused(50.0, False)
    tl = late.breakdown(60.0, attempts=1, engine_id="e1", tokens=0)
    assert (tl.charged_s, tl.paused_s, tl.contention_s) == pytest.approx((10.0, 25.0, 0.0))
    te = early.breakdown(60.0, attempts=1, engine_id="e1", tokens=0)
    assert (te.charged_s, te.paused_s) == pytest.approx((30.0, 30.0))


# --- the gateway ---------------------------------------------------------------------------------------------


def run_pause(*, unannounced: bool, seen_after_s: float) -> tuple[Harness, float, float]:
    """`a` streams for 20 s on e1; the trainer pauses e1 then for 30 s; the edge sees it `seen_after_s` in."""
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2)
    h.arrive("a", timeout_s=600.0, stall_timeout_s=60.0)
    h.advance(20.0, {"a": 0.5})  # the last token at 20.0: the pause begins just after it
    h.advance(seen_after_s)
    h.send(EnginePaused(engine_id="e1", unannounced=unannounced))
    h.advance(30.0 - seen_after_s)
    h.send(EngineResumed(engine_id="e1"))
    h.advance(10.0, {"a": 0.5})
    h.finish("a")
    timing = complete(h, "a").timing
    return h, timing.charged_s, timing.paused_s


@pytest.mark.parametrize("seen_after_s", [0.0, 5.0, 15.0, 29.0])
def test_the_silence_before_the_pause_was_seen_is_paused_not_charged(seen_after_s: float) -> None:
    h, charged, paused = run_pause(unannounced=True, seen_after_s=seen_after_s)
    assert (charged, paused) == pytest.approx((30.0, 30.0))
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == [] and h.commands(Fail) == []


def test_an_announced_pause_counts_from_when_it_is_told() -> None:
    _, charged, paused = run_pause(unannounced=False, seen_after_s=5.0)
    assert (charged, paused) == pytest.approx((35.0, 25.0))


def test_every_request_on_the_engine_gets_its_silence_back_and_others_keep_theirs() -> None:
    """Two calls on e1 (one streamed, one watched engine-level), one on e2 that progresses throughout; a call
    sent to e1 during the unseen pause was never charged; e2's is untouched."""
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=4, e2=4)
    h.arrive("a")
    h.arrive("x")
    h.arrive("b")
    assert (h.engine_of["a"], h.engine_of["x"], h.engine_of["b"]) == ("e1", "e2", "e1")
    h.advance(10.0, {"a": 0.5, "x": 0.5})
    h.send(
        ProgressReported(request_id="b", tokens=0, engine_level=True)
    )  # the last reading with tokens: 10.0
    h.advance(4.0, {"x": 0.5})
    h.arrive("c", pinned_engine="e1")  # sent to e1 while it is paused: it starts nothing
    assert h.engine_of["c"] == "e1"
    h.advance(8.0, {"x": 0.5})
    h.send(EnginePaused(engine_id="e1", unannounced=True))  # seen at 22.0
    h.advance(18.0, {"x": 0.5})
    h.send(EngineResumed(engine_id="e1"))  # at 40.0
    h.advance(5.0, {"a": 0.5, "b": 0.5, "c": 0.5, "x": 0.5})
    for rid in ("a", "b", "c", "x"):
        h.finish(rid)
    timing = {rid: complete(h, rid).timing for rid in ("a", "b", "c", "x")}
    assert (timing["a"].charged_s, timing["a"].paused_s) == pytest.approx((15.0, 30.0))
    assert (timing["b"].charged_s, timing["b"].paused_s) == pytest.approx((15.0, 30.0))
    assert (timing["c"].charged_s, timing["c"].paused_s) == pytest.approx((5.0, 26.0))
    assert (timing["x"].charged_s, timing["x"].paused_s) == pytest.approx((45.0, 0.0))
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == []


def test_the_counters_reading_of_the_last_token_places_the_pause_and_a_streamed_token_still_counts() -> None:
    """A call answered whole shows progress at counter readings (10.0, then the pause was seen before the
    next one): the edge's reading of when the last token came (12.0) places the pause, not the last reading.
    A token another call streamed after that estimate (13.0) says the engine still ran then."""
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=4)
    h.arrive("b")
    h.advance(10.0)
    h.send(ProgressReported(request_id="b", tokens=0, engine_level=True))  # the reading at 10.0
    h.advance(5.0)
    h.send(EnginePaused(engine_id="e1", unannounced=True, last_output_at=h.now - 3.0))  # 12.0, seen at 15.0
    h.advance(10.0)
    h.send(EngineResumed(engine_id="e1"))  # at 25.0
    h.advance(5.0, {"b": 0.5})
    h.finish("b")
    timing = complete(h, "b").timing
    assert (timing.charged_s, timing.paused_s) == pytest.approx((17.0, 13.0))

    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=4)
    h.arrive("b")
    h.arrive("s")
    h.advance(13.0, {"s": 0.5})  # s streams a token every 0.5 s until 13.0
    h.send(EnginePaused(engine_id="e1", unannounced=True, last_output_at=h.now - 1.0))  # 12.0
    h.advance(10.0)
    h.send(EngineResumed(engine_id="e1"))
    h.advance(5.0, {"b": 0.5, "s": 0.5})
    h.finish("b")
    timing = complete(h, "b").timing
    assert (timing.charged_s, timing.paused_s) == pytest.approx((18.0, 10.0))


def test_a_silence_longer_than_the_stall_timeout_seen_at_the_check_is_not_charged() -> None:
    """The pause outlasts the stall window before the health loop sees it: the core's check (CheckEngine)
    reads it, and the whole silence, stall window included, is paused."""
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2)
    h.arrive("a", stall_timeout_s=10.0)
    h.advance(5.0, {"a": 1.0})
    h.advance(9.0)  # CheckEngine at 13.0, 2 s before the window ends; the edge reads the pause at 14.0
    h.send(EnginePaused(engine_id="e1", unannounced=True))
    h.advance(100.0)
    h.send(EngineResumed(engine_id="e1"))
    h.advance(3.0, {"a": 1.0})
    h.finish("a")
    timing = complete(h, "a").timing
    assert (timing.charged_s, timing.paused_s) == pytest.approx((8.0, 109.0))
    assert h.commands(MarkEngine) == []


def test_a_repeated_unannounced_pause_forgives_nothing_twice() -> None:
    h = Harness(reference(hang_check_s=2.0))
    h.engines(e1=2)
    h.arrive("a")
    h.advance(10.0, {"a": 1.0})
    h.advance(5.0)
    h.send(EnginePaused(engine_id="e1", unannounced=True))
    h.advance(5.0)
    h.send(EnginePaused(engine_id="e1", unannounced=True))  # the health loop reports every reading
    h.advance(5.0)
    h.send(EngineResumed(engine_id="e1"))
    h.advance(2.0, {"a": 1.0})
    h.finish("a")
    timing = complete(h, "a").timing
    assert (timing.charged_s, timing.paused_s) == pytest.approx((12.0, 15.0))
