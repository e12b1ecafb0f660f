"""Session affinity with bounded load: keep a session on the engine that holds its prefix, within reason.

Theory of operation: a request whose session (routing key) lives on engine S (session_table.py) goes to S as long
as S is not overloaded relative to the pool:

    S.in_flight - min(in_flight of the eligible engines) <= max_excess      (within the bound)

Within the bound it goes to S if S can admit it now, and otherwise *waits for S* (choose returns None and the
gateway parks it in S's lane, where it does not block others). Beyond the bound the session moves: the request
is placed by least outstanding work like any request without a session, and its session is recorded on the new
engine when it is dispatched. A waiting session is looked at again whenever another engine frees a slot, with
the same test (`is_within_bound`), so a session whose engine stays saturated while others drain moves away.

Consistent hashing with bounded loads (Mirrokni et al.) bounds load relative to the average; bounding the excess
over the least loaded engine is simpler to reason about with small pools and capacities in the hundreds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rolloutgate.core.placement.base import (
    EngineView,
    PlacementRequest,
    choose_pinned,
    eligible,
    least_loaded,
)

__all__ = ("SessionAffinity", "is_within_bound")


def is_within_bound(affine_in_flight: int, least_in_flight: int, max_excess: int) -> bool:
    """True if a session may stay on (or wait for) an engine with `affine_in_flight` requests."""
    return affine_in_flight - least_in_flight <= max_excess


class SessionAffinity:
    name: ClassVar[str] = "session_affinity"

    __slots__ = ("max_excess",)

    def __init__(self, max_excess: int = 8) -> None:
        if max_excess < 0:
            raise ValueError("max_excess must be >= 0")
        self.max_excess = max_excess

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        candidates = eligible(request, engines)
        affine = request.affine_engine
        if affine is not None and candidates:
            least = min(e.in_flight for e in candidates)
            for engine in candidates:
                if engine.engine_id == affine:
                    if is_within_bound(engine.in_flight, least, self.max_excess):
                        return affine if engine.can_admit(request) else None
                    break
        return least_loaded(request, candidates)

    def __repr__(self) -> str:
        return f"<SessionAffinity max_excess={self.max_excess}>"
