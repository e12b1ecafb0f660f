"""The edge's one clock (server, simulator): the event loop's time. The core never imports this module.

Theory of operation: every timer at the edge is a loop timer (`call_at`, `asyncio.timeout`, sleeps), so reading
anything but the loop's own time would let two clocks drift apart, and a fake-time loop (looptime, in tests)
would move one and not the other. `LoopClock.now()` is the running loop's `time()`, times `scale` (1 in
production; the simulator's time scale otherwise), from `start_at`: the gateway's seconds start at 10,000 so
nothing mistakes them for wall time or for an uptime. The loop is the one running when the clock is first read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ("GATEWAY_EPOCH", "LoopClock")

GATEWAY_EPOCH = 1e4  # what the gateway's clock reads when it is first read


class LoopClock:
    """Seconds of the running event loop, `scale` times faster than real ones, from `start_at`."""

    __slots__ = ("_loop_time", "_origin", "_scale", "_start_at")

    def __init__(self, scale: float = 1.0, *, start_at: float = GATEWAY_EPOCH) -> None:
        if not scale > 0:
            raise ValueError(f"time scale must be > 0, got {scale!r}")
        self._scale = scale
        self._start_at = start_at
        self._loop_time: Callable[[], float] | None = None
        self._origin = 0.0

    @property
    def scale(self) -> float:
        return self._scale

    def now(self) -> float:
        loop_time = self._loop_time
        if loop_time is None:  # first read: bind to the running loop (RuntimeError outside one)
            loop_time = self._loop_time = asyncio.get_running_loop().time
            self._origin = loop_time()
        return (loop_time() - self._origin) * self._scale + self._start_at

    def real_seconds(self, clock_s: float) -> float:
        """How long `clock_s` seconds of this clock take on the loop's."""
        return clock_s / self._scale

    def __repr__(self) -> str:
        return f"<LoopClock x{self._scale:g} from {self._start_at:g}>"
