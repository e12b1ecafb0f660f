"""Sticky least-loaded placement (core/placement/sticky_least_loaded.py): a new session to the fewest sessions,
then its engine for good, within the load bound; never moved by the prefill cost."""

from __future__ import annotations

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.events import SessionEnded
from rolloutgate.core.placement import StickyLeastLoaded, make_policy
from tests.core.helpers import Harness, reference


def test_new_sessions_go_to_the_fewest_sessions_and_stay_even_where_a_cold_engine_is_idle() -> None:
    h = Harness(reference(placement="sticky_least_loaded", affinity_max_excess=2))
    h.engines(e0=8, e1=8)
    for s in "abcd":
        h.arrive(f"{s}1", routing_key=s, prompt_tokens=2000)
    assert [h.engine_of[f"{s}1"] for s in "abcd"] == ["e0", "e1", "e0", "e1"]
    for s in "abcd":
        h.progress(f"{s}1")
        h.finish(f"{s}1")
    h.send(SessionEnded(routing_key="b"))
    h.send(SessionEnded(routing_key="d"))
    h.arrive("e1", routing_key="e", prompt_tokens=2000)  # e1 holds no session now
    assert h.engine_of["e1"] == "e1"
    for turn in range(2, 6):  # a's calls stay on e0 while it is at most 2 busier than e1 (the bound)
        h.arrive(f"a{turn}", routing_key="a", prompt_tokens=2000 + turn)
    assert [h.engine_of[f"a{t}"] for t in range(2, 6)] == ["e0", "e0", "e0", "e0"]
    h.arrive("a6", routing_key="a", prompt_tokens=3000)  # e0 now 4 in flight, e1 1: over the bound, a moves
    assert h.commands(Dispatch)[-1].engine_id == "e1"
    assert isinstance(make_policy("sticky_least_loaded", max_excess=3), StickyLeastLoaded)
    assert repr(make_policy("sticky_least_loaded", max_excess=3)) == "<StickyLeastLoaded max_excess=3>"
