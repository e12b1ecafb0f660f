"""Staleness bounded by admission (`on_stale` "pace"): new work waits for the trainer, old work is never thrown away.

Theory of operation: aborting a generation that outlived the staleness bound and running it again (`requeue`)
biases training towards short answers, because the long ones are the ones that outlive updates
(tinker-cookbook#822). AReaL bounds staleness by pacing instead: the trainer consumes `batch` units of work
per weight version, so a unit admitted while fewer than `batch` x (V + K + 1) have been admitted in all is
consumed by version V + K + 1 at the latest: at most K versions stale, and nothing needs aborting. Here V is
the gateway's weight version (core/weights.py) and K `max_staleness`.

A unit of work is a call that opens some: one without a routing key, or the first call of a session. A later
turn of an admitted session is never held (its trajectory is under way: holding it would leave the work
half done and its prefix warm for nothing). A call over the budget is held: QUEUED (its queue clock and queue
timeout run as for any waiting call; the client is kept alive) but outside the queue, so it blocks no call
behind it. Each weight update raises the budget by `batch` and admits held calls in arrival order. A held
call that ends (its timeout, its client gone) leaves the line.

Rules:
1. `admitted` never exceeds `batch` x (version + K + 1).
2. Held calls are admitted in arrival order.
3. Off (`batch` or K None): every call is admitted and nothing is counted.
"""

from __future__ import annotations

from collections import deque

__all__ = ("StalenessPace",)


class StalenessPace:
    __slots__ = ("_held", "_held_ids", "admitted", "batch", "max_staleness")

    def __init__(self, batch: int | None, max_staleness: int | None) -> None:
        if batch is not None and batch < 1:
            raise ValueError(f"the pace's batch must be >= 1 (None: off), got {batch!r}")
        self.batch = batch
        self.max_staleness = max_staleness
        self.admitted = 0  # units of work admitted since the gateway started
        self._held: deque[str] = deque()
        self._held_ids: set[str] = set()

    @property
    def is_on(self) -> bool:
        return self.batch is not None and self.max_staleness is not None

    def budget(self, version: int) -> int:
        """Units that may be admitted in all by `version` (rule 1)."""
        assert self.batch is not None and self.max_staleness is not None
        return self.batch * (version + self.max_staleness + 1)

    def admit(self, request_id: str, *, opens_work: bool, version: int) -> bool:
        """A call arrives: True when it is admitted, False when it is held until an update makes room."""
        if not self.is_on or not opens_work:
            return True
        if not self._held and self.admitted < self.budget(version):
            self.admitted += 1
            return True
        self._held.append(request_id)
        self._held_ids.add(request_id)
        return False

    def release(self, version: int) -> list[str]:
        """After an update: the held calls the new budget admits, in arrival order (rule 2)."""
        released: list[str] = []
        if not self.is_on:
            return released
        budget = self.budget(version)
        while self._held and self.admitted < budget:
            request_id = self._held.popleft()
            self._held_ids.discard(request_id)
            self.admitted += 1
            released.append(request_id)
        return released

    def leave(self, request_id: str) -> None:
        """A call ends; a held one leaves the line without having been admitted."""
        if request_id in self._held_ids:
            self._held_ids.discard(request_id)
            self._held.remove(request_id)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held_ids

    def held_ids(self) -> frozenset[str]:
        return frozenset(self._held_ids)

    @property
    def held(self) -> int:
        return len(self._held_ids)

    def __repr__(self) -> str:
        state = (
            "off"
            if not self.is_on
            else f"batch {self.batch}, K {self.max_staleness}, {self.admitted} admitted"
        )
        return f"<StalenessPace {state} [{len(self._held_ids)} held]>"
