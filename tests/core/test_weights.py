"""Weight versions and the staleness bound: the gateway's version counter, and what a weight update does to
requests running since more than `max_staleness` versions back (re-queued from scratch, or left to their
engine to answer with their partial output)."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import GateClosed, GateOpened, PauseMode, WeightsUpdated
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
