"""Runs an `EngineModel` against the event loop's clock, `time_scale` times faster than its seconds.

Theory of operation: the driver owns one timer. It fires when the model's next step is due (mapped from
simulated to real time), never more often than every `MIN_WAKE_REAL_S`, and never while the model has
nothing due (idle, paused or frozen: no timer at all). Each wake-up advances the model to the current
simulated time, which may complete many steps at once at high time scales, and sets the listener (an
asyncio.Event) of every request that changed, so tokens reach handlers in bursts. After any command the
caller calls `poke()`, which schedules one wake-up on the next loop iteration (coalesced).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from rolloutgate.runtime_clock import LoopClock
from rolloutsim.engine_model import EngineModel

__all__ = ("SimDriver",)

MIN_WAKE_REAL_S = 0.002


class SimDriver:
    __slots__ = ("_after_wake", "_last_wake", "_loop", "_poked", "_timer", "_timer_at", "clock", "model")

    def __init__(
        self, model: EngineModel, clock: LoopClock, *, after_wake: Callable[[], None] | None = None
    ) -> None:
        self.model = model
        self.clock = clock
        self._after_wake = after_wake
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # loop time the timer fires at
        self._poked = False
        self._last_wake = -math.inf

    def now(self) -> float:
        """Simulated seconds."""
        return self.clock.now()

    def poke(self) -> None:
        """The model was changed: deliver its changes and re-arm the timer soon."""
        if not self._poked:
            self._poked = True
            self._loop.call_soon(self._wake)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = math.inf

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._wake()

    def _wake(self) -> None:
        self._poked = False
        self._last_wake = self._loop.time()
        for req in self.model.advance(self.clock.now()):
            listener = req.listener
            if listener is not None:
                listener.set()
        if self._after_wake is not None:
            self._after_wake()
        self._arm()

    def _arm(self) -> None:
        due = self.model.next_event_at()
        if math.isinf(due):
            self.close()
            return
        now_real = self._loop.time()
        fire_at = now_real + max(0.0, self.clock.real_seconds(due - self.clock.now()))
        fire_at = max(fire_at, self._last_wake + MIN_WAKE_REAL_S)
        if self._timer is not None:
            if self._timer_at <= fire_at + 1e-4:
                return  # an earlier (or the same) wake-up is already set
            self._timer.cancel()
        self._timer_at = fire_at
        self._timer = self._loop.call_later(fire_at - now_real, self._on_timer)

    def __repr__(self) -> str:
        return f"<SimDriver x{self.clock.scale:g} {self.model!r}>"
