"""Placement policies, one module each, behind the `PlacementPolicy` Protocol (base.py).

Theory of operation: `make_policy(name, ...)` maps a configuration name to a policy instance; the gateway asks
it `choose(request, engines)` for each request it wants to dispatch (dispatcher.py).
"""

from __future__ import annotations

import math

from rolloutgate.core.placement.base import EngineView, PlacementPolicy, PlacementRequest
from rolloutgate.core.placement.cache_warm import CacheWarm
from rolloutgate.core.placement.consistent_hash import ConsistentHash
from rolloutgate.core.placement.least_outstanding import LeastOutstanding
from rolloutgate.core.placement.prefill_aware import PrefillAware
from rolloutgate.core.placement.session_affinity import SessionAffinity, is_within_bound
from rolloutgate.core.placement.sticky_least_loaded import StickyLeastLoaded

__all__ = (
    "CacheWarm",
    "ConsistentHash",
    "EngineView",
    "LeastOutstanding",
    "PlacementPolicy",
    "PlacementRequest",
    "PrefillAware",
    "SessionAffinity",
    "StickyLeastLoaded",
    "is_within_bound",
    "make_policy",
)


def make_policy(name: str, *, max_excess: int = 8, cache_tokens: float = math.inf) -> PlacementPolicy:
    """The policy called `name` (`cache_tokens`: cache_warm's per-engine room for session histories).
    Raises ValueError for an unknown name."""
    if name == SessionAffinity.name:
        return SessionAffinity(max_excess)
    if name == LeastOutstanding.name:
        return LeastOutstanding()
    if name == PrefillAware.name:
        return PrefillAware(max_excess)
    if name == CacheWarm.name:
        return CacheWarm(max_excess, cache_tokens)
    if name == ConsistentHash.name:
        return ConsistentHash()
    if name == StickyLeastLoaded.name:
        return StickyLeastLoaded(max_excess)
    raise ValueError(f"unknown placement policy {name!r}")
