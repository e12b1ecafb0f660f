"""Weight versions and the staleness bound: the gateway's version counter, and what a weight update does to
requests running since more than `max_staleness` versions back (re-queued from scratch, or left to their
engine to answer with their partial output)."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import (
    ClientDisconnected,
    GateClosed,
    GateOpened,
    PauseMode,
    QueueAborted,
    WeightsUpdated,
)
from rolloutgate.core.weights import WeightVersions
from tests.core.helpers import Harness, of, reference


def test_without_a_bound_updates_only_count_versions() -> None:
    h = Harness()
    h.engines(e1=4)
    for rid, version in (("a", "v1"), ("b", "v2"), ("c", "v3")):
        h.arrive(rid)
        h.advance(10.0, {"a": 1.0})
        assert h.send(WeightsUpdated(engine_version=version)) == []
    stats = h.gw.stats()
    assert (stats.weight_version, stats.engine_weight_version) == (3, "v3")
    assert (stats.stale_requeued, stats.stale_partial, stats.in_flight_total) == (0, 0, 3)


@pytest.mark.parametrize(
    ("bound", "stale_at_each_update"),
    [
        (0, [["a"], ["a", "b"], ["a", "b", "c"]]),  # every update takes all that runs, re-queued first
        (1, [[], ["a"], ["b"]]),  # at update 3, a had started again under version 2
        (2, [[], [], ["a"]]),
        (3, [[], [], []]),
    ],
)
def test_requests_that_started_more_than_the_bound_back_are_requeued_from_scratch(
    bound: int, stale_at_each_update: list[list[str]]
) -> None:
    h = Harness(reference(max_staleness=bound))
    h.engines(e1=4)
    requeued = 0
    for rid, stale in zip(("a", "b", "c"), stale_at_each_update, strict=True):
        h.arrive(rid)  # a starts under version 0, b under 1, c under 2
        h.advance(10.0, {"a": 1.0, "b": 1.0, "c": 1.0})
        out = h.send(WeightsUpdated())
        assert [(x.request_id, x.reason) for x in of(out, Abort)] == [(r, AbortReason.STALE) for r in stale]
        # re-queued at the front and dispatched again at once (the gate is open), from scratch
        assert [(d.request_id, d.delivered_tokens) for d in of(out, Dispatch)] == [(r, 0) for r in stale]
        requeued += len(stale)
        assert h.gw.stats().stale_requeued == requeued
    h.advance(5.0, {"a": 1.0, "b": 1.0, "c": 1.0})
    for rid in ("a", "b", "c"):
        h.finish(rid)
    assert [c.request_id for c in h.commands(Complete)] == ["a", "b", "c"]
    assert h.commands(Fail) == []  # no client sees a failure


def test_a_requeued_stale_request_gives_its_charge_back_and_starts_under_the_new_version() -> None:
    h = Harness(reference(max_staleness=0))
    h.engines(e1=1)
    h.arrive("a")
    h.advance(40.0, {"a": 1.0})
    h.send(WeightsUpdated())
    assert h.attempt_of["a"] == 2
    h.send(WeightsUpdated())  # started under version 1, now 2: stale again
    assert h.attempt_of["a"] == 3
    h.advance(10.0, {"a": 1.0})
    h.finish("a")
    [done] = h.commands(Complete, "a")
    assert done.timing.charged_s == pytest.approx(10.0)  # the stale attempts were not the request's fault


def test_partial_aborts_on_the_engine_and_waits_for_its_answer() -> None:
    h = Harness(reference(max_staleness=0, on_stale="partial"))
    h.engines(e1=2)
    h.arrive("a")
    h.arrive("b")
    h.advance(30.0, {"a": 1.0, "b": 1.0})
    out = h.send(WeightsUpdated())
    assert [(x.request_id, x.reason) for x in of(out, Abort)] == [
        ("a", AbortReason.STALE_PARTIAL),
        ("b", AbortReason.STALE_PARTIAL),
    ]
    assert of(out, Dispatch) == [] and h.gw.stats().in_flight_total == 2  # still theirs: the engine answers
    assert h.send(WeightsUpdated()) == []  # judged once: no second abort while the answer is on its way
    h.finish("a")
    h.finish("b")
    assert [c.request_id for c in h.commands(Complete)] == ["a", "b"] and h.commands(Fail) == []
    assert h.gw.stats().stale_partial == 2 and h.gw.stats().live_requests == 0


def test_queued_requests_are_not_stale_and_an_update_behind_the_closed_gate_waits_for_it() -> None:
    h = Harness(reference(max_staleness=0))
    h.engines(e1=1)
    h.arrive("a")
    h.arrive("b")  # waits: one slot
    h.advance(10.0, {"a": 1.0})
    h.send(GateClosed(mode=PauseMode.IN_PLACE))
    out = h.send(WeightsUpdated())
    assert [(x.request_id, x.reason) for x in of(out, Abort)] == [("a", AbortReason.STALE)]
    assert of(out, Dispatch) == []  # the gate is closed: nothing starts yet
    out = h.send(GateOpened())
    assert [d.request_id for d in of(out, Dispatch)] == ["a"]  # a, re-queued at the front, before b


def test_the_bound_and_the_action_are_validated() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        GatewayCoreConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="on_stale"):
        GatewayCoreConfig(on_stale="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_staleness"):
        WeightVersions(-1)
    versions = WeightVersions(1)
    assert [versions.advance(None), versions.advance("v2")] == [1, 2]
    assert (versions.is_stale(0), versions.is_stale(1)) == (True, False)
    assert repr(versions) == "<WeightVersions v2 (v2) max_staleness=1>"
    assert repr(WeightVersions()) == "<WeightVersions v0 (None) max_staleness=off>"


# --- on_stale "pace": staleness bounded by admission (pace.py) -----------------------------------------------


def dispatched(h: Harness) -> list[str]:
    return [d.request_id for d in h.commands(Dispatch)]


def test_pace_holds_new_work_past_the_budget_and_aborts_nothing_at_an_update() -> None:
    """batch 2, K 0: two units by version 0, four by version 1; what runs across an update goes on."""
    h = Harness(reference(max_staleness=0, on_stale="pace", pace_batch=2))
    h.engines(e1=8)
    for rid in ("a", "b", "c", "d", "e"):
        h.arrive(rid)
    assert dispatched(h) == ["a", "b"]
    assert h.gw.stats().queue_depth == 3 and h.gw.inspect().held == {"c", "d", "e"}
    out = h.send(WeightsUpdated())
    assert of(out, Abort) == []  # a and b run on: nothing is thrown away
    assert dispatched(h) == ["a", "b", "c", "d"]  # in arrival order, up to the new budget
    assert h.gw.stats().stale_requeued == 0
    h.send(WeightsUpdated())
    assert dispatched(h) == ["a", "b", "c", "d", "e"]
    assert all(h.attempt_of[rid] == 1 for rid in "abcde")


def test_pace_counts_a_session_once_and_never_holds_its_later_turns() -> None:
    h = Harness(reference(max_staleness=1, on_stale="pace", pace_batch=1))
    h.engines(e1=8)
    h.arrive("s1-t1", routing_key="s1")
    h.arrive("s2-t1", routing_key="s2")  # budget 1 x (0 + 1 + 1) = 2
    h.arrive("s3-t1", routing_key="s3")  # held
    h.finish("s1-t1")
    h.arrive("s1-t2", routing_key="s1")  # a later turn of an admitted session: never held
    assert dispatched(h) == ["s1-t1", "s2-t1", "s1-t2"]
    h.send(WeightsUpdated())
    assert dispatched(h)[-1] == "s3-t1"


def test_a_held_call_that_ends_leaves_the_line() -> None:
    h = Harness(reference(max_staleness=0, on_stale="pace", pace_batch=1))
    h.engines(e1=8)
    h.arrive("a")
    h.arrive("b")
    h.arrive("c")
    h.send(ClientDisconnected(request_id="b"))
    h.advance(reference().retry_grace_s + 1.0)  # no retry came: it ends
    assert "b" not in h.gw.inspect().requests
    h.send(WeightsUpdated())
    assert dispatched(h) == ["a", "c"]
    assert h.gw.inspect().held == frozenset()


@pytest.mark.parametrize(
    "settings",
    [
        {"on_stale": "pace", "max_staleness": 1},  # no batch
        {"on_stale": "pace", "pace_batch": 4},  # no bound
        {"on_stale": "requeue", "max_staleness": 1, "pace_batch": 4},  # a batch without pace
        {"on_stale": "pace", "max_staleness": 1, "pace_batch": 0},
    ],
)
def test_pace_needs_its_bound_and_batch(settings: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="pace"):
        GatewayCoreConfig(**settings)  # type: ignore[arg-type]


def test_an_abort_of_everything_waiting_takes_the_held_calls_too() -> None:
    """SGLang's `abort_all` through the gateway (QueueAborted): a call held by the pace waits as surely as one in
    the queue, so it is answered as aborted with the rest."""
    h = Harness(reference(max_staleness=0, on_stale="pace", pace_batch=1))
    h.engines(e1=8)
    h.arrive("a")
    h.arrive("b")
    h.send(QueueAborted())
    assert [f.request_id for f in h.commands(Fail)] == ["b"]
    assert h.gw.inspect().held == frozenset()
