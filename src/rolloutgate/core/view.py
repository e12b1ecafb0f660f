"""What `Gateway.inspect()` returns: the core's state, read-only, as the property tests assert on it.

Theory of operation: `GatewayView` is a frozen snapshot taken when `inspect()` is called (as h11's tests read
`conn.states`): the live requests and engines by id, the wait queue's order, lanes and weights, the real-time
timers that are set, whether the gate is closed, and the dispatcher's summary. Its mappings are copies behind
read-only proxies, so the view does not change under the reader when the gateway handles the next event; the
records in them are the gateway's own (`RequestRecord`, `EngineRecord`, records.py): read them, never write
them. Taking a view is O(requests + timers + waiting log waiting): for tests and debugging, never the hot path;
the edge reads `Gateway.stats()` (stats.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from rolloutgate.core.ledger import Ledger, TimerKind
from rolloutgate.core.records import EngineRecord, RequestRecord
from rolloutgate.core.wait_queue import SHARED, Lane

__all__ = ("GatewayView", "QueueView", "view_of")


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueView:
    """The wait queue (wait_queue.py) as it was: who waits, in which lane, in what order, with what weight."""

    ids: tuple[str, ...]  # every waiting request id, ordered by sort key (`WaitQueue.ids_in_order`)
    lanes: Mapping[Lane, tuple[str, ...]]  # each non-empty lane's ids, in order (SHARED is None)
    weights: Mapping[str, int]  # waiting request id -> its weight (`WaitQueue.weight_of`)
    lane_weights: Mapping[Lane, int]  # non-empty lane -> the queue's total weight there

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.weights

    def __len__(self) -> int:
        return len(self.ids)

    def ids_in_lane(self, lane: Lane) -> tuple[str, ...]:
        """The lane's waiting request ids, in order (empty for an empty lane)."""
        return self.lanes.get(lane, ())

    def lane_weight(self, lane: Lane) -> int:
        """The total weight waiting in the lane (0 for an empty lane)."""
        return self.lane_weights.get(lane, 0)

    def weight_of(self, request_id: str) -> int:
        """The weight of a waiting request. Raises KeyError if it was not waiting."""
        return self.weights[request_id]


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayView:
    """The gateway core's state when `Gateway.inspect()` was called (see the module docstring)."""

    requests: Mapping[str, RequestRecord]  # live request id -> its record (queued or dispatched)
    engines: Mapping[str, EngineRecord]  # engine id -> its record, in join order
    queue: QueueView
    held: frozenset[
        str
    ]  # queued calls held outside the queue: over a session's cap, or past the pace's budget
    timers: Mapping[tuple[TimerKind, str], float]  # each real-time timer set -> when it is due (ledger.py)
    is_gate_closed: bool
    dispatcher: str  # the dispatcher's repr: its placement policy and how many wait


def view_of(ledger: Ledger) -> GatewayView:
    """A snapshot of the ledger's state (`Gateway.inspect`)."""
    queue = ledger.queue
    lanes: list[Lane] = [SHARED, *queue.engine_lanes()]
    in_lanes = {lane: tuple(queue.ids_in_lane(lane)) for lane in lanes}
    return GatewayView(
        requests=MappingProxyType(dict(ledger.requests)),
        engines=MappingProxyType(dict(ledger.engines)),
        held=ledger.session_cap.held_ids() | ledger.pace.held_ids(),
        queue=QueueView(
            ids=tuple(queue.ids_in_order()),
            lanes=MappingProxyType({lane: ids for lane, ids in in_lanes.items() if ids}),
            weights=MappingProxyType({rid: queue.weight_of(rid) for rid in queue}),
            lane_weights=MappingProxyType(
                {lane: queue.lane_weight(lane) for lane, ids in in_lanes.items() if ids}
            ),
        ),
        timers=MappingProxyType(ledger.timers.deadlines()),
        is_gate_closed=ledger.gate.is_closed,
        dispatcher=repr(ledger.dispatcher),
    )
