"""Busy is not dead: an engine's first work may show nothing for minutes (a compile on its first request), and
is not judged hung for it; an engine that is warm is judged on its stall window alone (core/liveness.py,
"Warm-up"; docs/reliability.md). Synchronous, on a ManualClock."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Abort, CheckEngine, MarkEngine
from rolloutgate.core.events import EngineHealthChecked, UpstreamFailed
from tests.core.helpers import Harness, of, reference

STALL_S = 60.0
WARMUP_S = 300.0
CHECK_S = 2.0


def production_liveness() -> Harness:
    """The reference world with the production liveness: the pause check and the warm-up."""
    return Harness(reference(hang_check_s=CHECK_S, warmup_timeout_s=WARMUP_S))


def quarantined_at(h: Harness, engine_id: str) -> list[float]:
    return [
        t
        for t, c in h.log
        if isinstance(c, MarkEngine) and c.engine_id == engine_id and c.state == "quarantined"
    ]


def test_a_first_request_that_compiles_for_two_minutes_is_not_a_hang() -> None:
    h = production_liveness()
    h.engines(e1=4)
    h.arrive("a", stall_timeout_s=STALL_S)
    h.arrive("b", stall_timeout_s=STALL_S)
    h.advance(120.0)  # compiling: nothing at all from the engine
    assert h.commands(MarkEngine) == [] and h.commands(CheckEngine) == [] and h.commands(Abort) == []
    h.advance(30.0, {"a": 0.1, "b": 0.1})
    h.finish("a")
    h.finish("b")
    assert h.commands(MarkEngine) == [] and h.commands(Abort) == []


def test_an_engine_frozen_on_its_first_work_is_caught_when_the_warm_up_ends() -> None:
    h = production_liveness()
    h.engines(e1=4, e2=4)
    busy_at = h.now
    h.arrive("a", stall_timeout_s=STALL_S)
    assert h.gw.stats().engines[0].hung_at == pytest.approx(busy_at + WARMUP_S)
    h.advance(WARMUP_S - CHECK_S - 0.1)
    assert h.commands(CheckEngine) == []
    h.advance(0.1)
    assert h.commands(CheckEngine) == [CheckEngine(engine_id="e1")]
    out = h.advance(CHECK_S)
    assert quarantined_at(h, "e1") == [pytest.approx(busy_at + WARMUP_S)]
    assert [(a.request_id, a.engine_id) for a in of(out, Abort)] == [("a", "e1")]


def test_once_it_progressed_its_stall_window_alone_applies() -> None:
    h = production_liveness()
    h.engines(e1=4, e2=4)
    h.arrive("a", stall_timeout_s=STALL_S)
    h.advance(100.0)  # compiling
    h.advance(20.0, {"a": 0.5})
    frozen_at = h.now
    assert h.gw.stats().engines[0].hung_at == pytest.approx(frozen_at + STALL_S)
    h.advance(STALL_S)  # frozen after its compile: caught on the stall window, not the warm-up
    assert quarantined_at(h, "e1") == [pytest.approx(frozen_at + STALL_S)]


def test_a_quarantine_lifted_by_a_passing_check_gets_no_new_warm_up() -> None:
    h = production_liveness()
    h.engines(e1=4, e2=4)
    h.arrive("a", stall_timeout_s=STALL_S)
    h.advance(10.0, {"a": 0.5})
    h.advance(STALL_S)  # frozen: caught, `a` moves to e2
    assert len(quarantined_at(h, "e1")) == 1 and h.engine_of["a"] == "e2"
    h.send(EngineHealthChecked(engine_id="e1", healthy=True))  # its /health says 200 (a wedge)
    back_at = h.now
    h.arrive("b", pinned_engine="e1", stall_timeout_s=STALL_S)
    h.advance(STALL_S, {"a": 0.5})
    assert quarantined_at(h, "e1")[1:] == [pytest.approx(back_at + STALL_S)]


@pytest.mark.parametrize("failure", ["health check", "refused connection"])
def test_an_engine_marked_unhealthy_may_be_a_new_process_and_warms_up_again(failure: str) -> None:
    h = production_liveness()
    h.engines(e1=4, e2=4)
    h.arrive("a", stall_timeout_s=STALL_S)
    h.advance(10.0, {"a": 0.5})
    h.finish("a")  # e1 is warm
    h.arrive("b", stall_timeout_s=STALL_S)
    assert h.engine_of["b"] == "e1"
    if failure == "health check":
        h.send(EngineHealthChecked(engine_id="e1", healthy=False))  # restarting: its checks failed
    else:
        h.send(UpstreamFailed(request_id="b", reason="refused", retryable=True, engine_unreachable=True))
    assert h.gw.stats().engine_states["e1"] == "unhealthy"
    h.advance(60.0, {"b": 0.5} if h.engine_of["b"] == "e2" else None)
    h.send(EngineHealthChecked(engine_id="e1", healthy=True))  # back: its first request compiles again
    back_at = h.now
    h.arrive("c", pinned_engine="e1", stall_timeout_s=STALL_S)
    h.advance(WARMUP_S - 0.1)
    assert quarantined_at(h, "e1") == []
    h.advance(0.1)
    assert quarantined_at(h, "e1") == [pytest.approx(back_at + WARMUP_S)]


def test_no_warm_up_means_the_stall_window_from_the_first_work() -> None:
    h = Harness(reference(hang_check_s=CHECK_S, warmup_timeout_s=0.0))
    h.engines(e1=4, e2=4)
    busy_at = h.now
    h.arrive("a", stall_timeout_s=STALL_S)
    h.advance(STALL_S)
    assert quarantined_at(h, "e1") == [pytest.approx(busy_at + STALL_S)]
