"""The gateway's record of one request: what it asked for, where it is, and its clock.

Theory of operation: created on `RequestArrived`, freed when the request ends (Complete, Fail, or forgotten
after its client left). The record survives re-dispatches: `attempt` counts dispatches, `fault_attempts` the
dispatches that count against `max_attempts` (the first one plus each retry after a refused connection, a hung
engine or a stuck request), `tokens` the output seen so far in the visible stream.

Rules:
1. `state` changes only through `move_to`, which consults request_state.TRANSITIONS.
2. `engine` is set exactly while the request is dispatched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rolloutgate.core.events import RequestArrived, RequestLimits
from rolloutgate.core.request_clock import RequestClock
from rolloutgate.core.request_state import RequestState, transition
from rolloutgate.core.wait_queue import SortKey

if TYPE_CHECKING:
    from rolloutgate.core.engine_record import EngineRecord

__all__ = ("FRESH_TIER", "FRONT_TIER", "NO_ENGINES", "RequestRecord")

FRONT_TIER = 0  # put back at the queue front (re-queued)
# one shared empty set: an empty frozenset() is a new 216-byte object each time, held by every request
NO_ENGINES: frozenset[str] = frozenset()
FRESH_TIER = 1


class RequestRecord:
    __slots__ = (
        "attempt",
        "avoid_engines",
        "clock",
        "delivered_tokens",
        "engine",
        "fault_attempts",
        "is_disconnected",
        "is_in_prefill",
        "is_large_prefill",
        "limits",
        "pinned_engine",
        "prefill_due_at",
        "prefills_endured",
        "priority",
        "prompt_tokens",
        "request_id",
        "routing_key",
        "seq",
        "state",
        "streaming",
        "stuck_count",
        "tier",
        "tokens",
        "uncached_tokens",
    )

    def __init__(self, event: RequestArrived, *, seq: int, now: float) -> None:
        limits: RequestLimits = event.limits
        self.request_id = event.request_id
        self.limits = limits
        self.routing_key = event.routing_key
        self.priority = event.priority
        self.prompt_tokens = event.prompt_tokens
        self.streaming = event.streaming
        self.pinned_engine = event.pinned_engine
        self.seq = seq
        self.tier = FRESH_TIER
        self.state = RequestState.RECEIVED
        self.clock = RequestClock(
            arrived_at=now, timeout_s=limits.timeout_s, stall_timeout_s=limits.stall_timeout_s
        )
        self.engine: EngineRecord | None = None
        self.attempt = 0
        self.fault_attempts = 1
        self.stuck_count = 0
        self.tokens = 0
        self.delivered_tokens = 0
        self.uncached_tokens = 0
        self.is_in_prefill = False
        self.is_large_prefill = False
        self.prefill_due_at = (
            0.0  # when this attempt's prefill is over at the floor rate (engine-level progress)
        )
        self.prefills_endured = 0  # long prefills its engine finished while it decoded there (this attempt)
        self.is_disconnected = False
        self.avoid_engines: frozenset[str] = NO_ENGINES

    @property
    def sort_key(self) -> SortKey:
        return (self.tier, self.priority, self.seq)

    def move_to(self, state: RequestState) -> None:
        """Change state; raises InvalidTransition (state unchanged) if the table forbids it."""
        self.state = transition(self.state, state)

    def __repr__(self) -> str:
        where = f" on {self.engine.engine_id}" if self.engine is not None else ""
        return f"<RequestRecord {self.request_id} {self.state.value}{where} attempt={self.attempt}>"
