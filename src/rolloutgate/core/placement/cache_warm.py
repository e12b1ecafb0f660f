"""Cache-warm placement: a new session goes where the fewest sessions live and its history has room.

Theory of operation
-------------------
An engine's prefix cache holds the histories of the sessions placed there. Sessions that keep their engine
(affinity) prefill only their new tokens each turn, as long as the cache keeps their history: it evicts the
least recently used blocks once the histories of the sessions living there outgrow it, and then every turn of
those sessions is a cold prefill again. Least outstanding work balances requests in flight, not the sessions
bound to each engine; with turns of uneven length the bindings pile up unevenly, and an engine that holds
more histories than its cache evicts them (and a policy without affinity loses the cache at every turn).

So a request whose session the table does not know yet (`PlacementRequest.is_new_session`, no affine
engine) goes, among the eligible engines with a free slot, to the one

    1. whose bound sessions' histories plus this one fit its cache (`session_tokens + prompt <= cache_tokens`;
       math.inf: the cache size is not known and every engine fits),
    2. with the fewest sessions bound to it (`active_sessions`; a session's end releases its binding,
       session_table.py `release`),
    3. then the least loaded (requests in flight, prefill tokens, engine order).

Every other request (a known session, a group sibling whose group is placed, no session at all) is placed
as prefill_aware places it: its cached prefix priced against a cold prefill elsewhere, within the load bound
of session affinity.

Rules:
1. Pure: no mutation, no randomness; O(E) per decision.
2. Pinned requests go only to their engine (`choose_pinned`); avoided engines only as a last resort.
3. `choose` returns an engine with a free slot, or None (the dispatcher parks a choice that cannot admit the
   request now in that engine's lane, as for prefill_aware).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from rolloutgate.core.placement.base import EngineView, PlacementRequest, choose_pinned, eligible
from rolloutgate.core.placement.prefill_aware import PrefillAware

__all__ = ("CacheWarm", "fewest_sessions")


def fewest_sessions(
    request: PlacementRequest, engines: Sequence[EngineView], cache_tokens: float = math.inf
) -> str | None:
    """A new session's engine (module docstring): with a free slot, its history fitting, the fewest sessions
    bound, then the least loaded; None when no eligible engine has a free slot."""
    best: EngineView | None = None
    best_key: tuple[bool, int, int, int, int] | None = None
    for engine in eligible(request, engines):
        if not engine.has_room():
            continue
        is_full = engine.session_tokens + request.prompt_tokens > cache_tokens
        key = (is_full, engine.active_sessions, engine.in_flight, engine.outstanding_tokens, engine.order)
        if best_key is None or key < best_key:
            best, best_key = engine, key
    return None if best is None else best.engine_id


class CacheWarm:
    name: ClassVar[str] = "cache_warm"

    __slots__ = ("_known", "cache_tokens")

    def __init__(self, max_excess: int = 8, cache_tokens: float = math.inf) -> None:
        if math.isnan(cache_tokens) or cache_tokens <= 0:
            raise ValueError("cache_tokens must be > 0 (math.inf: unknown)")
        self._known = PrefillAware(max_excess)
        self.cache_tokens = cache_tokens

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        if not request.is_new_session or request.affine_engine is not None:
            return self._known.choose(request, engines)
        return fewest_sessions(request, engines, self.cache_tokens)

    def __repr__(self) -> str:
        return f"<CacheWarm max_excess={self._known.max_excess} cache_tokens={self.cache_tokens:g}>"
