"""The real clock, for the edges (server, simulator). The core never imports this module."""

from __future__ import annotations

import random
import time

__all__ = ("MonotonicClock", "ScaledClock")


class MonotonicClock:
    """`time.monotonic()` plus a random offset, so code that mixes in raw `time` values fails fast."""

    __slots__ = ("_offset",)

    def __init__(self, offset: float | None = None) -> None:
        self._offset = random.uniform(1e4, 2e5) if offset is None else offset

    def now(self) -> float:
        return time.monotonic() + self._offset


class ScaledClock:
    """Simulated seconds that run `scale` times faster than real ones (time scale of the simulator)."""

    __slots__ = ("_origin", "_scale")

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0, got {scale!r}")
        self._scale = scale
        self._origin = time.monotonic()

    @property
    def scale(self) -> float:
        return self._scale

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self._scale

    def real_seconds(self, simulated_s: float) -> float:
        """How long `simulated_s` simulated seconds take in real time."""
        return simulated_s / self._scale
