"""Timeouts of waiting readers, one loop timer for all of them (the keep-alive waits of every open request).

Theory of operation: each request's handler waits for its next item at most a keep-alive interval
(`Outbox.get(timeout_s)`). A loop timer per wait (`call_later`) is ~650 bytes (handle, arguments, context,
libuv timer) held by every stream in flight, and two calls per item. Here a wait is one heap entry
`(at, seq, waiter)` (~120 bytes), and one loop timer stays armed at the earliest live entry. The waiter is the
reader's future: it is resolved `True` when its time comes (timed out) and stays as it is otherwise; an entry
whose future is already done (the item came first) is stale and dropped when it surfaces, or all at once when
stale entries outnumber the live ones.

Why not the core's `TimerHeap`: a wait is added and settled for every event of every stream, and keyed
deletion (an id per wait, the heap's live map, a map from id to future) made a wait cost 3.7-4.1 us against
1.8-2.8 us here (200,000 waits beside 500 live ones, both measured in one run), which `scripts/ab_gateway.sh
4441abb stream 32 4 4` saw as +5.2% gateway CPU per streamed request. Here the future's own `done()` is the
deletion mark, so nothing is keyed.

Rules:
1. A wait times out no earlier than its deadline and, the loop permitting, at it (the timer is armed at the
   earliest entry whose waiter is not done).
2. `settled()` must follow each `add()` once the wait is over (however it ended): it keeps the live count.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref

__all__ = ("WaitDeadlines", "deadlines_of")

_COMPACT_SLACK = 64

_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WaitDeadlines] = weakref.WeakKeyDictionary()


def deadlines_of(loop: asyncio.AbstractEventLoop) -> WaitDeadlines:
    """The loop's one `WaitDeadlines` (created on first use)."""
    deadlines = _by_loop.get(loop)
    if deadlines is None:
        deadlines = _by_loop[loop] = WaitDeadlines()
    return deadlines


class WaitDeadlines:
    """Deadlines of waiting futures on one loop (module docstring)."""

    __slots__ = ("_heap", "_live", "_seq", "_timer", "_timer_at")

    def __init__(self) -> None:  # no reference to its loop: the loop is the key of its entry in `_by_loop`
        self._heap: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._live = 0
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, timeout_s: float, waiter: asyncio.Future[bool]) -> None:
        """Resolve `waiter` with True in `timeout_s` seconds unless it is done by then (call on its loop)."""
        at = asyncio.get_running_loop().time() + timeout_s
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, waiter))
        self._live += 1
        if at < self._timer_at:
            self._arm(at)

    def settled(self) -> None:
        """One wait is over (rule 2)."""
        self._live -= 1
        if len(self._heap) > 2 * self._live + _COMPACT_SLACK:
            self._heap = [entry for entry in self._heap if not entry[2].done()]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._live

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        heap = self._heap
        now = asyncio.get_running_loop().time()
        while heap and (heap[0][0] <= now or heap[0][2].done()):
            _, _, waiter = heapq.heappop(heap)
            if not waiter.done():
                waiter.set_result(True)
        if heap:
            self._arm(heap[0][0])

    def __repr__(self) -> str:
        return (
            f"<WaitDeadlines [{self._live} waiting, {len(self._heap)} entries, next at {self._timer_at:.3f}]>"
        )
