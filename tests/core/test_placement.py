"""Placement policies against plain engine views (table-driven)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rolloutgate.core.placement import (
    LeastOutstanding,
    PlacementRequest,
    SessionAffinity,
    is_within_bound,
    make_policy,
)


@dataclass
class View:
    engine_id: str
    order: int
    in_flight: int
    outstanding_tokens: int = 0
    capacity: int = 4
    budget: float = float("inf")
    prefill: int = 0
    decoding: int = 0
    backlog_tokens: int = 0

    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    def can_admit(self, request: PlacementRequest) -> bool:
        uncached = request.uncached_on(self.engine_id)
        if self.in_flight >= self.capacity:
            return False
        return self.prefill == 0 or self.prefill + uncached <= self.budget


def views(*loads: int, **kw: int) -> list[View]:
    return [View(engine_id=f"e{i}", order=i, in_flight=n, **kw) for i, n in enumerate(loads)]


def req(**kw: object) -> PlacementRequest:
    return PlacementRequest(request_id="r", prompt_tokens=100, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("loads", "tokens", "expected"),
    [
        ((2, 1, 3), (0, 0, 0), "e1"),
        ((1, 1, 1), (5, 3, 9), "e1"),  # tie on count: fewer outstanding tokens
        ((1, 1, 1), (0, 0, 0), "e0"),  # full tie: engine order
        ((4, 4, 4), (0, 0, 0), None),  # all full
    ],
)
def test_least_outstanding(loads: tuple[int, ...], tokens: tuple[int, ...], expected: str | None) -> None:
    engines = views(*loads)
    for e, t in zip(engines, tokens, strict=True):
        e.outstanding_tokens = t
    assert LeastOutstanding().choose(req(), engines) == expected


def test_avoided_engines_only_as_last_resort() -> None:
    engines = views(0, 3)
    assert LeastOutstanding().choose(req(avoid_engines=frozenset({"e0"})), engines) == "e1"
    assert LeastOutstanding().choose(req(avoid_engines=frozenset({"e0"})), engines[:1]) == "e0"
    engines[1].in_flight = 4  # the other engine is full: wait rather than go back to the avoided one
    assert LeastOutstanding().choose(req(avoid_engines=frozenset({"e0"})), engines) is None


@pytest.mark.parametrize("policy", [LeastOutstanding(), SessionAffinity(2)])
def test_pinned_goes_only_there(policy: LeastOutstanding | SessionAffinity) -> None:
    engines = views(0, 3)
    assert policy.choose(req(pinned_engine="e1"), engines) == "e1"
    engines[1].in_flight = 4
    assert policy.choose(req(pinned_engine="e1"), engines) is None
    assert policy.choose(req(pinned_engine="gone"), engines) is None


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ((3, 0, 1), "e0"),  # affine e0 has room and is within the bound (3 - 0 <= 3)
        ((4, 1, 2), None),  # affine e0 full, within the bound: wait for it
        ((4, 0, 2), "e1"),  # affine e0 beyond the bound (4 - 0 > 3): the session moves to the least loaded
    ],
)
def test_session_affinity_with_bounded_load(loads: tuple[int, ...], expected: str | None) -> None:
    assert SessionAffinity(max_excess=3).choose(req(affine_engine="e0"), views(*loads)) == expected


def test_affinity_uses_the_cache_for_the_budget() -> None:
    engines = views(1, 0, budget=1000)
    engines[0].prefill = 950
    cached = req(affine_engine="e0", affine_cached_tokens=50)  # 50 uncached on e0: fits 950 + 50
    assert SessionAffinity(8).choose(cached, engines) == "e0"
    uncached = req(affine_engine="e0", affine_cached_tokens=0)  # 100 uncached: 1000 exceeded, wait for e0
    assert SessionAffinity(8).choose(uncached, engines) is None


def test_affinity_without_session_or_unknown_engine_is_least_loaded() -> None:
    assert SessionAffinity(1).choose(req(), views(2, 1)) == "e1"
    assert SessionAffinity(1).choose(req(affine_engine="gone"), views(2, 1)) == "e1"


def test_bound_helper_and_factory() -> None:
    assert is_within_bound(5, 2, 3) and not is_within_bound(6, 2, 3)
    assert make_policy("least_outstanding").name == "least_outstanding"
    assert make_policy("prefill_aware", max_excess=3).name == "prefill_aware"
    assert isinstance(make_policy("session_affinity", max_excess=4), SessionAffinity)
    with pytest.raises(ValueError):
        make_policy("random")
    with pytest.raises(ValueError):
        SessionAffinity(-1)
    assert req(affine_engine="e0", affine_cached_tokens=150).uncached_on("e0") == 0
