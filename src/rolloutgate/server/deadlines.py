"""Timeouts of waiting readers, one loop timer for all of them (the keep-alive waits of every open request).

Theory of operation: each request's handler waits for its next item at most a keep-alive interval
(`Outbox.get(timeout_s)`). A loop timer per wait (`call_later`) is ~650 bytes (handle, arguments, context,
libuv timer) held by every stream in flight, and two calls per item. Here a wait is a key in the core's
`TimerHeap` (the one timer structure of the tree: lazy deletion, compacted as stale entries pile up) and its
reader's future, and one loop timer stays armed at the earliest deadline. The future is resolved `True` when
its time comes (timed out) and stays as it is otherwise.

Rules:
1. A wait times out no earlier than its deadline and, the loop permitting, at it (the timer is armed at the
   earliest entry whose waiter is not done).
2. `settled(key)` must follow each `add()` once the wait is over (however it ended): it drops the wait.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import weakref

from rolloutgate.core.timer_heap import TimerHeap

__all__ = ("WaitDeadlines", "deadlines_of")

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WaitDeadlines] = weakref.WeakKeyDictionary()


def deadlines_of(loop: asyncio.AbstractEventLoop) -> WaitDeadlines:
    """The loop's one `WaitDeadlines` (created on first use)."""
    deadlines = _by_loop.get(loop)
    if deadlines is None:
        deadlines = _by_loop[loop] = WaitDeadlines()
    return deadlines


class WaitDeadlines:
    """Deadlines of waiting futures on one loop (module docstring)."""

    __slots__ = ("_due", "_keys", "_timer", "_timer_at", "_waiters")

    def __init__(self) -> None:  # no reference to its loop: the loop is the key of its entry in `_by_loop`
        self._due: TimerHeap[int] = TimerHeap()
        self._waiters: dict[int, asyncio.Future[bool]] = {}
        self._keys = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, timeout_s: float, waiter: asyncio.Future[bool]) -> int:
        """Resolve `waiter` with True in `timeout_s` seconds unless it is done by then (call on its loop); the
        key to settle it with."""
        at = asyncio.get_running_loop().time() + timeout_s
        key = next(self._keys)
        self._waiters[key] = waiter
        self._due.set(key, at)
        if at < self._timer_at:
            self._arm(at)
        return key

    def settled(self, key: int) -> None:
        """The wait is over (rule 2)."""
        self._due.discard(key)
        self._waiters.pop(key, None)

    def __len__(self) -> int:
        return len(self._waiters)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        now = asyncio.get_running_loop().time()
        while (key := self._due.pop_due(now)) is not None:
            waiter = self._waiters[key]
            if not waiter.done():
                waiter.set_result(True)
        next_at = self._due.next_at()
        if next_at != math.inf:
            self._arm(next_at)

    def __repr__(self) -> str:
        return f"<WaitDeadlines [{len(self._waiters)} waiting, next at {self._timer_at:.3f}]>"
