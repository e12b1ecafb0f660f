"""A cap on each session's calls in the gateway at once: those over it wait, in order, outside the queue.

Theory of operation: an agent that fans one session out into many concurrent calls (parallel tool calls, a
retrying client) takes a share of the engines out of proportion and piles them on its one engine (affinity).
SMG caps the calls in flight per routing key (2); here `session_max_in_flight` caps a key's calls *admitted*:
waiting in the queue or running on an engine. A call that arrives over the cap is held: QUEUED (its queue
clock and queue timeout run as for any waiting call; the client is kept alive) but not in the queue, so it
never blocks the calls behind it. When one of its session's admitted calls leaves the gateway (answered,
failed, cancelled) the oldest held call of that session is admitted and enters the queue with its arrival
order, so it goes first among what arrived after it. A held call that ends (its timeout, its client gone)
leaves its session's line. Calls without a routing key are not capped. A retry or a call moved to another
engine stays admitted: it never left.

Rules:
1. `admitted(key)` counts the key's live calls that are not held; it never exceeds the cap.
2. A key's held calls are admitted in arrival order, one per admitted call that leaves.
3. math.inf: no cap; nothing is counted (the common case costs one comparison per call).
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ("SessionCap",)


class SessionCap:
    __slots__ = ("_admitted", "_held", "_held_ids", "cap")

    def __init__(self, cap: float = math.inf) -> None:
        if not cap >= 1:
            raise ValueError("the cap on a session's calls must be >= 1 (math.inf: none)")
        self.cap = cap
        self._admitted: dict[str, int] = {}
        self._held: dict[str, deque[str]] = {}
        self._held_ids: set[str] = set()

    def admit(self, routing_key: str | None, request_id: str) -> bool:
        """A call arrives: True when it is admitted (counted), False when it is held (over its session's cap)."""
        if routing_key is None or self.cap == math.inf:
            return True
        admitted = self._admitted.get(routing_key, 0)
        if admitted < self.cap:
            self._admitted[routing_key] = admitted + 1
            return True
        self._held.setdefault(routing_key, deque()).append(request_id)
        self._held_ids.add(request_id)
        return False

    def leave(self, routing_key: str | None, request_id: str) -> str | None:
        """A call ends (rule 2): the held call of its session admitted in its place, if any."""
        if routing_key is None or self.cap == math.inf:
            return None
        line = self._held.get(routing_key)
        if request_id in self._held_ids:  # a held call that ended before its turn
            self._held_ids.discard(request_id)
            assert line is not None
            line.remove(request_id)
            if not line:
                del self._held[routing_key]
            return None
        if line:
            successor = line.popleft()
            self._held_ids.discard(successor)
            if not line:
                del self._held[routing_key]
            return successor  # takes the place: the count stays
        left = self._admitted[routing_key] - 1
        if left:
            self._admitted[routing_key] = left
        else:
            del self._admitted[routing_key]
        return None

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held_ids

    def held_ids(self) -> frozenset[str]:
        """The calls held now (for `Gateway.inspect`)."""
        return frozenset(self._held_ids)

    def admitted(self, routing_key: str) -> int:
        return self._admitted.get(routing_key, 0)

    @property
    def held(self) -> int:
        """Calls held now, all sessions."""
        return len(self._held_ids)

    def __repr__(self) -> str:
        return f"<SessionCap {self.cap:g} [{len(self._admitted)} sessions, {len(self._held_ids)} held]>"
