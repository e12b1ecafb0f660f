"""What the pool holds of each engine: a joined engine's handle, and a registered one that has not joined yet.

Plain records, shared by the pool (server/pool.py), its health watch (server/engine_health.py) and the admin and
RL control calls that pause or hold an engine; the engine's state is the core's (one source of it), read
through the pool.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rolloutgate.config import EngineSpec
from rolloutgate.core.engine_state import EngineState
from rolloutgate.engines.base import EngineClient, EngineInfo, SchedulerSnapshot

__all__ = ("HEALTHY", "PENDING", "QUARANTINED", "EngineHandle", "PendingEngine")

HEALTHY = EngineState.HEALTHY.value
QUARANTINED = EngineState.QUARANTINED.value
PENDING = "pending"  # registered, not joined yet: its probe has not succeeded (server/pool.py)


@dataclass(eq=False, slots=True)
class EngineHandle:
    engine_id: str
    url: str
    client: EngineClient
    info: EngineInfo
    capacity: int
    health_task: asyncio.Task[None] | None = None
    consecutive_failures: int = 0
    maintenance: int = 0  # > 0 while the admin API pauses or updates it: health checks are not judged
    paused_by_engine: bool = False  # it says it is paused, and not by the gateway (a trainer, directly)
    # what a trainer's calls through the RL control plane stopped on it ("pause", "sleep": server/rl_plane.py)
    control_holds: set[str] = field(default_factory=set)
    # an engine without a pause flag seen paused by its scheduler's frozen snapshot: that snapshot, until it moves
    paused_snapshot: SchedulerSnapshot | None = None

    def is_in_maintenance(self) -> bool:
        return self.maintenance > 0

    def describe(self, state: str | None) -> dict[str, object]:
        """The engine as the admin API shows it, with its state in the core (an EngineState value)."""
        return {
            "id": self.engine_id,
            "url": self.url,
            "family": self.info.family.value,
            "capacity": self.capacity,
            "healthy": state == HEALTHY,
            "state": state,
            "paused_by_engine": self.paused_by_engine,
            "models": list(self.info.models),
            "weight_version": self.info.weight_version,
            "missing": list(self.info.missing),
        }


@dataclass(eq=False, slots=True)
class PendingEngine:
    """An engine registered and not joined yet (server/pool.py, "Registration"): probed again until it answers."""

    engine_id: str  # the one it joins with
    spec: EngineSpec
    registered_at: float  # wall-clock seconds
    first_try: asyncio.Future[None]  # set once its first probe ended, whatever the outcome
    task: asyncio.Task[None] | None = None
    attempts: int = 0
    error: str | None = None  # why the last probe failed

    @property
    def url(self) -> str:
        return self.spec.url

    def describe(self) -> dict[str, object]:
        """As the worker API shows an engine (EngineHandle.describe), with what its probes met."""
        return {
            "id": self.engine_id,
            "url": self.spec.url,
            "family": self.spec.family,
            "capacity": self.spec.capacity,
            "healthy": False,
            "state": PENDING,
            "paused_by_engine": False,
            "models": [],
            "weight_version": None,
            "missing": [],
            "registered_at": self.registered_at,
            "attempts": self.attempts,
            "error": self.error,
        }
