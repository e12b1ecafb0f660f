"""Clocks for the sans-IO core.

Theory of operation: the core never reads time. Every method that depends on time takes `now: float`,
seconds on some monotonic clock chosen by the caller. Tests drive the core with `ManualClock`; the server and
the simulator use `rolloutgate.runtime_clock.LoopClock` (the event loop's time). Absolute times end in `_at`, durations in `_s`,
and `math.inf` means "never".
"""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ("Clock", "ManualClock")


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...


class ManualClock:
    """A clock that moves only when told to."""

    __slots__ = ("_now",)

    def __init__(self, start_at: float = 1000.0) -> None:
        self._now = start_at

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (>= 0) and return the new time."""
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"cannot advance a clock by {seconds!r}")
        self._now += seconds
        return self._now

    def __repr__(self) -> str:
        return f"<ManualClock now={self._now:.3f}>"
