"""Least outstanding work: the engine with the fewest requests in flight.

Theory of operation: the classic least-outstanding-requests balancer (the miles router's choice, and the
fallback of session affinity). Ties break on outstanding prompt tokens still in prefill, then on engine order.
Session keys only inform the uncached-token estimate (admission); they never bind a request to an engine.
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

__all__ = ("LeastOutstanding",)


class LeastOutstanding:
    name: ClassVar[str] = "least_outstanding"

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        return least_loaded(request, eligible(request, engines))

    def __repr__(self) -> str:
        return "<LeastOutstanding>"
