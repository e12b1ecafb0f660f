"""Placement policies, one module each, behind the `PlacementPolicy` Protocol (base.py).

Theory of operation: `make_policy(name, ...)` maps a configuration name to a policy instance; the gateway asks
it `choose(request, engines)` for each request it wants to dispatch (dispatcher.py).
"""

from __future__ import annotations

from rolloutgate.core.placement.base import EngineView, PlacementPolicy, PlacementRequest
from rolloutgate.core.placement.least_outstanding import LeastOutstanding
from rolloutgate.core.placement.prefill_aware import PrefillAware
from rolloutgate.core.placement.session_affinity import SessionAffinity, is_within_bound

__all__ = (
    "EngineView",
    "LeastOutstanding",
    "PlacementPolicy",
    "PlacementRequest",
    "PrefillAware",
    "SessionAffinity",
    "is_within_bound",
    "make_policy",
)


def make_policy(name: str, *, max_excess: int = 8) -> PlacementPolicy:
    """The policy called `name`. Raises ValueError for an unknown name."""
    if name == SessionAffinity.name:
        return SessionAffinity(max_excess)
    if name == LeastOutstanding.name:
        return LeastOutstanding()
    if name == PrefillAware.name:
        return PrefillAware(max_excess)
    raise ValueError(f"unknown placement policy {name!r}")
