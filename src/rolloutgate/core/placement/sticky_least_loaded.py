"""Sticky least-loaded: a new session goes where the fewest sessions live and stays there, within the load bound.

Theory of operation: prime-rl's default since prime-rl#3563 and SkyRL's (SkyRL#1791), vllm-router's
`sticky_least_loaded` (vllm-project/router#235): a session the gateway does not know yet (a new routing key,
`PlacementRequest.is_new_session`) goes to the engine with the fewest sessions bound to it (a session's end
releases its binding: DELETE, `/finish_session`, its idle bound; core/session_table.py), then the least
loaded (cache_warm.py `fewest_sessions`); every later call of the session goes to that engine, waiting for it
when it is full, as session affinity places it (session_affinity.py): it moves only when its engine is more
than `max_excess` calls busier than the least loaded, or is gone. Unlike cache-warm placement, a known
session's call is never moved to a cheaper engine by the prefill cost: its history's cache is where it is.

Rules:
1. Pure: no mutation, no randomness; O(E) per decision.
2. Pinned requests go only to their engine; avoided engines only as a last resort.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rolloutgate.core.placement.base import EngineView, PlacementRequest, choose_pinned
from rolloutgate.core.placement.cache_warm import fewest_sessions
from rolloutgate.core.placement.session_affinity import SessionAffinity

__all__ = ("StickyLeastLoaded",)


class StickyLeastLoaded:
    name: ClassVar[str] = "sticky_least_loaded"

    __slots__ = ("_known",)

    def __init__(self, max_excess: int = 8) -> None:
        self._known = SessionAffinity(max_excess)

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        if request.is_new_session and request.affine_engine is None:
            return fewest_sessions(request, engines)
        return self._known.choose(request, engines)

    def __repr__(self) -> str:
        return f"<StickyLeastLoaded max_excess={self._known.max_excess}>"
