"""Charge meters: what an engine (or the gateway's queue) was doing, integrated over time, per charge class.

Theory of operation
-------------------
A request's life is a sequence of *stints*: queued in the gateway, or dispatched to one engine. Each stint runs
on a `ChargeMeter`. Every engine has one, and the gateway's wait queue has one (the "pool meter"). A meter
integrates, over time, which *mode* its owner was in:

    PAUSED      the gate is closed, or (engines) the engine itself is paused
    FREE        not paused, and no large prefill is in progress on the engine
    SOLO        not paused, and exactly one large prefill is in progress
    CONTENDED   not paused, and two or more large prefills are in progress

("large" = at least `contention_min_prefill_tokens` uncached prompt tokens, dispatched, no progress yet.)
The pool meter is only ever PAUSED or FREE. Each request on an engine belongs to a *charge class*:

    FREE class  an ordinary request: charged while the engine is FREE
    SOLO class  a request that is itself a large prefill: charged while the engine is SOLO (it is the only one)

so a request is never charged while the gate or its engine is paused, nor while ANOTHER request on its engine is
in a large prefill (contention). A request's charged time is the growth of its class's integral over its stints
(request_clock.py): reading it is O(1), and a change of the engine's mode (a prefill starting or ending, a
pause) is O(1) for the engine no matter how many requests it runs. The meter's class integral is also the
request's *virtual time*: budgets become virtual deadlines ("class integral reaches V"), kept in per-engine
timer heaps, and turned into a real deadline only while the class's integral is running (`real_at`).

A pause learned late. An engine that paused itself (a trainer's direct pause) is seen by the edge a while
after it began; all the core knows is that it began after the engine's last progress. `backdate_pause(since,
now)` counts the meter PAUSED from `since`: the class time the meter integrated since then moves to `paused`
(every request on the meter charged from `since` on gets it back at once, since a request's charge is the
growth of its class's integral). The meter keeps the last `HISTORY` mode changes to know what each mode took
since `since`; a pause older than those is counted from the oldest one kept (forgiving less, never more).

Rules:
1. This module and request_clock.py are the one home of budget arithmetic: no other module adds or subtracts
   durations to judge a budget.
2. `now` never decreases across calls for one meter (the driver's clock is monotonic).
"""

from __future__ import annotations

import enum
import math

__all__ = ("EPSILON_S", "HISTORY", "ChargeClass", "ChargeMeter")

EPSILON_S = 1e-6
"""Virtual deadlines within this of the meter's value are due (float rounding between real and virtual time)."""


class ChargeClass(enum.IntEnum):
    FREE = 0  # charged while no large prefill runs on the engine
    SOLO = 1  # itself a large prefill: charged while it is the only one


_PAUSED, _FREE, _SOLO, _CONTENDED = 0, 1, 2, 3

HISTORY = 32
"""Mode changes a meter keeps for `backdate_pause` (changes come with large prefills and pauses: rare)."""


class ChargeMeter:
    """Integrates an engine's (or the queue's) modes over time; see the module docstring."""

    __slots__ = (
        "_at",
        "_big",
        "_history",
        "_is_paused",
        "_mode",
        "free_mark",
        "free_total",
        "paused_total",
        "solo_mark",
        "solo_total",
    )

    def __init__(self, *, is_paused: bool = False) -> None:
        self._at = 0.0
        self._is_paused = is_paused
        self._big = 0
        self._mode = _PAUSED if is_paused else _FREE
        self.paused_total = 0.0
        self.free_total = 0.0
        self.solo_total = 0.0
        self.free_mark = 0.0  # class integrals at the last resume: stall windows start there
        self.solo_mark = 0.0
        # (at, free_total, solo_total, paused_total, mode from then on), one per mode change, oldest first
        self._history: list[tuple[float, float, float, float, int]] = [(0.0, 0.0, 0.0, 0.0, self._mode)]

    # --- changes ---------------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        dt = now - self._at
        if dt > 0:
            mode = self._mode
            if mode == _FREE:
                self.free_total += dt
            elif mode == _PAUSED:
                self.paused_total += dt
            elif mode == _SOLO:
                self.solo_total += dt
        self._at = now

    def _set_mode(self) -> None:
        if self._is_paused:
            mode = _PAUSED
        else:
            mode = _FREE if self._big == 0 else _SOLO if self._big == 1 else _CONTENDED
        if mode != self._mode:
            self._mode = mode
            history = self._history
            history.append((self._at, self.free_total, self.solo_total, self.paused_total, mode))
            if len(history) > HISTORY:
                del history[0]

    def set_paused(self, now: float, is_paused: bool) -> None:
        """Enter or leave PAUSED. Leaving it restarts the stall windows of the meter's requests."""
        self._advance(now)
        if self._is_paused and not is_paused:
            self.free_mark = self.free_total
            self.solo_mark = self.solo_total
        self._is_paused = is_paused
        self._set_mode()

    def backdate_pause(self, since: float, now: float) -> float:
        """The meter's owner has been paused since `since` (at the latest; learned now): count [since, now]
        as PAUSED and stay PAUSED. Returns the time the pause is counted from: `since`, or the oldest mode
        change kept if `since` is older (module docstring)."""
        self._advance(now)
        since = min(since, now)
        history = self._history
        i = len(history) - 1
        while i > 0 and history[i][0] > since:
            i -= 1
        at, free, solo, paused, mode = history[i]
        since = max(since, at)
        dt = since - at
        if mode == _FREE:
            free += dt
        elif mode == _SOLO:
            solo += dt
        elif mode == _PAUSED:
            paused += dt
        self.free_total, self.solo_total = free, solo
        self.paused_total = paused + (now - since)
        self.free_mark = min(self.free_mark, free)
        self.solo_mark = min(self.solo_mark, solo)
        del history[i + 1 :]
        history.append((since, free, solo, paused, _PAUSED))
        self._is_paused = True
        self._mode = _PAUSED
        return since

    def add_large_prefill(self, now: float) -> None:
        self._advance(now)
        self._big += 1
        self._set_mode()

    def remove_large_prefill(self, now: float) -> None:
        self._advance(now)
        if self._big <= 0:
            raise ValueError("no large prefill to remove")
        self._big -= 1
        self._set_mode()

    # --- readings --------------------------------------------------------------------------------------

    @property
    def large_prefills(self) -> int:
        return self._big

    def is_running(self, cls: ChargeClass) -> bool:
        """True if requests of class `cls` are being charged now."""
        return self._mode == (_FREE if cls is ChargeClass.FREE else _SOLO)

    def value(self, cls: ChargeClass, now: float) -> float:
        """The class integral at `now` (virtual time of class `cls`)."""
        if cls is ChargeClass.FREE:
            return self.free_total + (now - self._at if self._mode == _FREE else 0.0)
        return self.solo_total + (now - self._at if self._mode == _SOLO else 0.0)

    def paused_value(self, now: float) -> float:
        return self.paused_total + (now - self._at if self._mode == _PAUSED else 0.0)

    def mark(self, cls: ChargeClass) -> float:
        return self.free_mark if cls is ChargeClass.FREE else self.solo_mark

    def real_at(self, cls: ChargeClass, virtual_at: float, now: float) -> float:
        """When (real time) the class integral reaches `virtual_at` if the mode stays as it is; inf if stopped."""
        if virtual_at == math.inf or not self.is_running(cls):
            return math.inf
        return now + max(0.0, virtual_at - self.value(cls, now))

    def __repr__(self) -> str:
        mode = ("paused", "free", "solo", "contended")[self._mode]
        return f"<ChargeMeter {mode} large_prefills={self._big} free={self.free_total:.3f}>"
