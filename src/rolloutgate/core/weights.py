"""Weight versions: the gateway's own count of weight updates, and the staleness bound.

Theory of operation: every weight update the gateway is told of (`WeightsUpdated`, sent by the admin edge once
the engines serve the new weights) advances one integer version, starting at 0. The engines' own version
strings (SGLang `weight_version`) are kept beside it, the last one reported, never parsed: an engine's label
is the trainer's, the counter is the gateway's. Each attempt of a request is stamped with the version it was
dispatched under (`RequestRecord.started_version`).

The staleness bound (`max_staleness` K, None: off): at an update to version V, a request running since a
version older than V - K is stale. With K = 0 every request that started before the update is; with K = 1
those that lived through one update already and now see a second. What happens to a stale request is the
edge's setting `on_stale`: "requeue" aborts it on its engine and queues it again at the front, to start from
scratch under V (its client sees nothing but the wait); "partial" aborts it on its engine and keeps it there,
so the engine answers it with the tokens generated so far and finish reason `abort` (miles' partial rollouts
put such samples back in their buffer); "pace" aborts nothing and bounds staleness by admission instead
(pace.py: new work waits while the trainer is behind).

Rules:
1. The version only grows, by one per update.
2. A request is judged stale once per attempt: a partial one is not judged again while its engine answers it.
"""

from __future__ import annotations

from typing import Literal

__all__ = ("ON_STALE", "OnStale", "WeightVersions")

OnStale = Literal["requeue", "partial", "pace"]
ON_STALE: tuple[OnStale, ...] = ("requeue", "partial", "pace")


class WeightVersions:
    """The gateway's weight version and the staleness rule; see the module docstring."""

    __slots__ = ("engine_version", "max_staleness", "stale_partial", "stale_requeued", "version")

    def __init__(self, max_staleness: int | None = None) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (None: off), got {max_staleness!r}")
        self.max_staleness = max_staleness
        self.version = 0
        self.engine_version: str | None = None  # the engines' label of the last update, when told
        self.stale_requeued = 0
        self.stale_partial = 0

    def advance(self, engine_version: str | None) -> int:
        """Count one update; returns the new version."""
        self.version += 1
        if engine_version is not None:
            self.engine_version = engine_version
        return self.version

    def is_stale(self, started_version: int) -> bool:
        """Whether an attempt dispatched under `started_version` is past the bound now."""
        bound = self.max_staleness
        return bound is not None and started_version < self.version - bound

    def __repr__(self) -> str:
        bound = "off" if self.max_staleness is None else str(self.max_staleness)
        return f"<WeightVersions v{self.version} ({self.engine_version}) max_staleness={bound}>"
