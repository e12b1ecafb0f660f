"""A keyed min-heap of deadlines with lazy deletion: the core's one timer structure.

Theory of operation: every timer in the core is "key K is due at T" where T is a float on some clock (real
seconds, or the virtual charged-time of one engine, see request_clock.py). Setting a key again replaces its
deadline; discarding it cancels it. Both are O(log n) / O(1): the old heap entry is left in place and skipped
when it surfaces (each entry carries a sequence number, and only the key's latest number is live). The heap is
rebuilt from the live entries when stale ones outnumber them, so memory stays O(live timers). Deadlines that tie
are due in key order: which one fires first depends on what is set, never on the order it was set in (the
driver's deferred deadlines and the eager ones then give the same commands in the same order).

Rules:
1. `math.inf` means "never": setting a key to inf is the same as discarding it.
2. NaN is refused (ValueError): a NaN deadline would never compare as due and would leak.
3. Keys must be hashable and ordered among themselves (the core's are strings and (kind, id) tuples).
"""

from __future__ import annotations

import heapq
import math
from typing import Generic, TypeVar

__all__ = ("TimerHeap",)

K = TypeVar("K")

_COMPACT_SLACK = 64


class TimerHeap(Generic[K]):
    """Keyed deadlines; `next_at()` is the earliest live one (math.inf if none)."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, K, int]] = []
        self._live: dict[K, tuple[int, float]] = {}
        self._seq = 0

    def set(self, key: K, at: float) -> None:
        """Make `key` due at `at` (replacing any earlier setting). Raises ValueError for NaN."""
        if at != at:  # NaN
            raise ValueError(f"deadline for {key!r} is NaN")
        if at == math.inf:
            self.discard(key)
            return
        entry = self._live.get(key)
        if entry is not None and entry[1] == at:
            return  # unchanged: no new heap entry
        self._seq += 1
        self._live[key] = (self._seq, at)
        heapq.heappush(self._heap, (at, key, self._seq))
        if len(self._heap) > 2 * len(self._live) + _COMPACT_SLACK:
            self._compact()

    def discard(self, key: K) -> None:
        """Cancel `key` if it is set; no effect otherwise."""
        if self._live.pop(key, None) is not None and not self._live:
            self._heap.clear()

    def at_of(self, key: K) -> float:
        """The deadline of `key`, or math.inf if it is not set."""
        entry = self._live.get(key)
        return math.inf if entry is None else entry[1]

    def deadlines(self) -> dict[K, float]:
        """Every live key with its deadline (a copy). O(live timers): for inspection, not the hot path."""
        return {key: at for key, (_, at) in self._live.items()}

    def next_at(self) -> float:
        """The earliest live deadline, or math.inf."""
        heap = self._heap
        live = self._live
        while heap:
            at, key, seq = heap[0]
            entry = live.get(key)
            if entry is not None and entry[0] == seq:
                return at
            heapq.heappop(heap)
        return math.inf

    def pop_due(self, limit: float) -> K | None:
        """Remove and return the key with the earliest deadline if that deadline is <= `limit`, else None."""
        at = self.next_at()
        if at > limit or at == math.inf:  # nothing due (an empty heap is never due, even at limit inf)
            return None
        _, key, _ = heapq.heappop(self._heap)
        del self._live[key]
        return key

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def _compact(self) -> None:
        self._heap = [(at, key, seq) for key, (seq, at) in self._live.items()]
        heapq.heapify(self._heap)

    def __repr__(self) -> str:
        return f"<TimerHeap [{len(self._live)} live, next at {self.next_at():.3f}]>"
