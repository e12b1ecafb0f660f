"""Cache-warm placement (core/placement/cache_warm.py): new sessions to the fewest sessions with room."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.events import SessionEnded
from rolloutgate.core.placement import CacheWarm, PlacementRequest, PrefillAware, make_policy
from tests.core.helpers import Harness, reference


@dataclass
class View:
    engine_id: str
    order: int
    in_flight: int = 0
    active_sessions: int = 0
    session_tokens: int = 0
    outstanding_tokens: int = 0
    decoding: int = 0
    decode_weight: int = 0
    backlog_tokens: int = 0
    capacity: int = 4

    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    def can_admit(self, request: PlacementRequest) -> bool:
        return self.has_room()


def new_session(prompt_tokens: int = 10_000, **kw: object) -> PlacementRequest:
    return PlacementRequest(request_id="r", prompt_tokens=prompt_tokens, is_new_session=True, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sessions", "tokens", "in_flight", "cache_tokens", "expected"),
    [
        ((3, 1, 2), (0, 0, 0), (0, 3, 0), math.inf, "e1"),  # fewest sessions, though the busiest
        ((1, 1, 2), (0, 0, 0), (2, 1, 0), math.inf, "e1"),  # tie on sessions: least loaded
        ((1, 2, 3), (95_000, 0, 0), (0, 0, 0), 100_000.0, "e1"),  # e0's cache has no room for 10K more
        ((1, 2, 3), (95_000, 95_000, 95_000), (0, 0, 0), 100_000.0, "e0"),  # none has room: fewest still
        ((0, 0, 0), (0, 0, 0), (4, 4, 4), math.inf, None),  # every engine full
    ],
)
def test_a_new_session_goes_to_the_fewest_sessions_whose_cache_has_room(
    sessions: tuple[int, ...],
    tokens: tuple[int, ...],
    in_flight: tuple[int, ...],
    cache_tokens: float,
    expected: str | None,
) -> None:
    views = [
        View(engine_id=f"e{i}", order=i, active_sessions=s, session_tokens=t, in_flight=n)
        for i, (s, t, n) in enumerate(zip(sessions, tokens, in_flight, strict=True))
    ]
    assert CacheWarm(8, cache_tokens).choose(new_session(), views) == expected


def test_known_sessions_groups_and_keyless_requests_are_placed_as_prefill_aware_places_them() -> None:
    views = [View(engine_id="e0", order=0, active_sessions=5), View(engine_id="e1", order=1, in_flight=2)]
    warm, aware = CacheWarm(8), PrefillAware(8)
    for request in (
        PlacementRequest(
            request_id="r", prompt_tokens=20_000, affine_engine="e0", affine_cached_tokens=19_000
        ),
        new_session(affine_engine="e0", affine_cached_tokens=20_000),  # a new session of a placed group
        PlacementRequest(request_id="r", prompt_tokens=500),
    ):
        assert warm.choose(request, views) == aware.choose(request, views)
    assert warm.choose(new_session(pinned_engine="e0"), views) == "e0"
    assert warm.choose(new_session(avoid_engines=frozenset({"e1"})), views) == "e0"


def test_the_policy_is_made_by_name_and_refuses_a_cache_of_no_room() -> None:
    policy = make_policy("cache_warm", max_excess=3, cache_tokens=1e6)
    assert isinstance(policy, CacheWarm) and repr(policy) == "<CacheWarm max_excess=3 cache_tokens=1e+06>"
    with pytest.raises(ValueError, match="cache_tokens"):
        CacheWarm(8, 0)


def test_in_the_core_new_sessions_spread_by_bound_sessions_and_an_ended_session_frees_its_place() -> None:
    """Four sessions whose first turns end at once land two per engine; the second engine's sessions end
    (SessionEnded); the next two new sessions both go there, although it is no less busy."""
    h = Harness(reference(placement="cache_warm"))
    h.engines(e0=8, e1=8)
    for s in ("a", "b", "c", "d"):
        h.arrive(f"{s}1", routing_key=s, prompt_tokens=2000)
    assert [h.engine_of[f"{s}1"] for s in "abcd"] == ["e0", "e1", "e0", "e1"]
    for s in "abcd":
        h.progress(f"{s}1")
        h.finish(f"{s}1")
    h.send(SessionEnded(routing_key="b"))
    h.send(SessionEnded(routing_key="d"))
    h.arrive("x", prompt_tokens=100)  # keyless: least loaded (e0)
    h.arrive("g1", routing_key="g", prompt_tokens=2000)
    h.arrive("f1", routing_key="f", prompt_tokens=2000)
    assert [h.engine_of[r] for r in ("x", "g1", "f1")] == ["e0", "e1", "e1"]
    h.arrive("a2", routing_key="a", prompt_tokens=3000)  # a known session stays where its history is
    assert h.commands(Dispatch)[-1].engine_id == "e0"


def test_in_the_core_a_session_idle_past_its_bound_frees_its_place_and_a_long_call_keeps_it() -> None:
    """`session_idle_s` 600: a session whose last call ended 600+ s ago no longer counts on its engine, while
    one whose call has run for 900 s (far past the bound) still does, and takes its next turn there."""
    h = Harness(reference(placement="cache_warm", session_idle_s=600.0))
    h.engines(e0=8, e1=8)
    h.arrive("a1", routing_key="a", prompt_tokens=2000)
    h.arrive("b1", routing_key="b", prompt_tokens=2000)
    assert (h.engine_of["a1"], h.engine_of["b1"]) == ("e0", "e1")
    h.progress("a1")
    h.finish("a1")  # a on e0 goes idle; b1 runs on and on
    h.advance(599.0, streams={"b1": 1.0})
    h.arrive("c1", routing_key="c", prompt_tokens=2000)  # one session bound on each: the least loaded
    assert h.engine_of["c1"] == "e0"
    h.progress("c1")
    h.finish("c1")
    h.advance(301.0, streams={"b1": 1.0})  # a idle 900 s: released; c idle 301 s; b busy for 900 s
    h.arrive("d1", routing_key="d", prompt_tokens=2000)
    assert h.engine_of["d1"] == "e0"  # a released: one session on each, e0 the less loaded (a kept: e1)
    h.arrive("f1", routing_key="f", prompt_tokens=2000)
    assert h.engine_of["f1"] == "e1"  # now e0 holds c and d, e1 holds b
    h.arrive("b2", routing_key="b", prompt_tokens=3000)
    assert h.engine_of["b2"] == "e1"  # b's binding outlived the bound while its call ran
