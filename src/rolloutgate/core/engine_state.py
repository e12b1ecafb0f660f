"""An engine's health: one enum and its transition table.

Theory of operation: an engine that joins healthy takes work. A failed health check or a connection the adapter
judged "unreachable" makes it UNHEALTHY; the liveness rule (liveness.py) makes a hung engine QUARANTINED. Only a
passing health check (`EngineHealthChecked(healthy=True)`) brings either back to HEALTHY. A quarantined engine
stays quarantined through failing checks: it was caught hung and must prove itself healthy again, and the edge
makes its check a one-token generation (server/pool.py), since a `/health` 200 does not prove that an engine
generates (vLLM#46811).

Being paused (a weight update on that engine) is orthogonal to health and is a flag on the engine record.
Every change is announced to the edges as `MarkEngine(state=<value>)`.

Rules:
1. Changes go through `transition()`; an illegal one raises `InvalidTransition`.
2. Only HEALTHY, unpaused engines receive work (placement checks `is_schedulable`).
"""

from __future__ import annotations

import enum

from rolloutgate.core.request_state import InvalidTransition

__all__ = ("TRANSITIONS", "EngineState", "transition")


class EngineState(enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed a health check or refused connections
    QUARANTINED = "quarantined"  # caught hung: no progress while it had work


TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.HEALTHY: frozenset({EngineState.UNHEALTHY, EngineState.QUARANTINED}),
    EngineState.UNHEALTHY: frozenset({EngineState.HEALTHY, EngineState.QUARANTINED}),
    EngineState.QUARANTINED: frozenset({EngineState.HEALTHY}),
}


def transition(current: EngineState, wanted: EngineState) -> EngineState:
    """Return `wanted` if the table allows `current -> wanted`; raise `InvalidTransition` otherwise."""
    if wanted not in TRANSITIONS[current]:
        raise InvalidTransition("engine", current, wanted)
    return wanted
