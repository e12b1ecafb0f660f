"""The gateway's records of one request and of one engine, which point at each other (a request at the engine
it is dispatched to, an engine at the requests dispatched there), so they live in one module.

`RequestRecord`: created on `RequestArrived`, freed when the request ends (Complete, Fail, or forgotten after its
client left). The record survives re-dispatches: `attempt` counts dispatches, `fault_attempts` the dispatches
that count against `max_attempts` (the first one plus each retry after a refused connection, a hung engine or a
stuck request), `prefill_losses` the engines that dropped it before its first token, `tokens` the output seen so far in the visible stream.

`EngineRecord`: one per engine in the pool, owned by the gateway. It composes the per-engine parts
(admission.EngineSlots, charge_meter.ChargeMeter, liveness.EngineLiveness) and two timer heaps, one per charge
class, holding each in-flight request's next virtual deadline (charged timeout or stall check, see
request_clock.py). It is also the read-only `EngineView` that placement policies see.

Rules:
1. A request's `state` changes only through `move_to`, which consults request_state.TRANSITIONS.
2. A request's `engine` is set exactly while the request is dispatched.
3. Only the gateway mutates an engine record; policies read it through `EngineView`.
4. An engine's `requests` holds exactly the requests dispatched there and not yet ended or moved.
5. `endured_prefills` is the sum of `prefills_endured` over `requests` (kept by the gateway, O(1) per event).
"""

from __future__ import annotations

import math

from rolloutgate.core.admission import EngineSlots
from rolloutgate.core.charge_meter import ChargeMeter
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.events import RequestArrived, RequestLimits
from rolloutgate.core.liveness import EngineLiveness
from rolloutgate.core.placement.base import PlacementRequest
from rolloutgate.core.request_clock import RequestClock
from rolloutgate.core.request_state import RequestState, transition
from rolloutgate.core.session_table import SessionTable
from rolloutgate.core.timer_heap import TimerHeap
from rolloutgate.core.wait_queue import SortKey, WaitQueue

__all__ = ("FRESH_TIER", "FRONT_TIER", "NO_ENGINES", "EngineRecord", "RequestRecord")

FRONT_TIER = 0  # put back at the queue front (re-queued)
# one shared empty set: an empty frozenset() is a new 216-byte object each time, held by every request
NO_ENGINES: frozenset[str] = frozenset()
FRESH_TIER = 1


class RequestRecord:
    __slots__ = (
        "attempt",
        "avoid_engines",
        "clock",
        "continuable",
        "delivered_tokens",
        "engine",
        "fault_attempts",
        "group",
        "is_disconnected",
        "is_in_prefill",
        "is_large_prefill",
        "is_stale_answering",
        "limits",
        "max_version_lag",
        "pinned_engine",
        "prefill_due_at",
        "prefill_losses",
        "prefills_endured",
        "priority",
        "prompt_tokens",
        "request_id",
        "routing_key",
        "seq",
        "started_version",
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
        self.continuable = event.continuable
        self.pinned_engine = event.pinned_engine
        self.max_version_lag = event.max_version_lag
        self.group = event.group
        self.seq = seq
        self.tier = FRESH_TIER
        self.state = RequestState.RECEIVED
        self.clock = RequestClock(
            arrived_at=now, timeout_s=limits.timeout_s, stall_timeout_s=limits.stall_timeout_s
        )
        self.engine: EngineRecord | None = None
        self.attempt = 0
        self.started_version = 0  # the gateway's weight version its attempt was dispatched under (weights.py)
        self.is_stale_answering = False  # aborted as stale, its engine answering it with its partial output
        self.fault_attempts = 1
        self.stuck_count = 0
        self.prefill_losses = (
            0  # engines that dropped it before its first token (on_requests.py, poison requests)
        )
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

    def allows_weights_of(self, engine: EngineRecord) -> bool:
        """Its version policy lets it start on `engine`: a pinned request anywhere (its caller chose the
        engine), any other where the engine's weights are at most `max_version_lag` versions behind."""
        lag = self.max_version_lag
        return lag is None or self.pinned_engine is not None or engine.version_lag <= lag

    def move_to(self, state: RequestState) -> None:
        """Change state; raises InvalidTransition (state unchanged) if the table forbids it."""
        self.state = transition(self.state, state)

    def __repr__(self) -> str:
        where = f" on {self.engine.engine_id}" if self.engine is not None else ""
        return f"<RequestRecord {self.request_id} {self.state.value}{where} attempt={self.attempt}>"


class EngineRecord:
    __slots__ = (
        "_queue",
        "_sessions",
        "endured_prefills",
        "engine_id",
        "generated_tokens",
        "is_draining",
        "is_paused",
        "liveness",
        "meter",
        "order",
        "requests",
        "slots",
        "state",
        "timers",
        "version_lag",
    )

    def __init__(
        self,
        *,
        engine_id: str,
        order: int,
        now: float,
        capacity: float,
        prefill_token_budget: float,
        is_healthy: bool,
        is_gate_closed: bool,
        pool_stall_timeout_s: float = math.inf,
        budget_exempt_tokens: int = 0,
        rest_ratio: float = 0.0,
        queue: WaitQueue | None = None,
        sessions: SessionTable | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.order = order
        self.state = EngineState.HEALTHY if is_healthy else EngineState.UNHEALTHY
        self.is_paused = False
        self.is_draining = False  # handed to another gateway: no new work (core/events.py EngineDraining)
        self.version_lag = 0  # weight versions behind the newest in the pool (EngineVersionLag)
        self.generated_tokens = 0  # output tokens its requests' own streams reported (not engine-level)
        self.slots = EngineSlots(
            capacity=capacity,
            prefill_token_budget=prefill_token_budget,
            exempt_below_tokens=budget_exempt_tokens,
            rest_ratio=rest_ratio,
        )
        self.meter = ChargeMeter(is_paused=is_gate_closed)
        self.meter.set_paused(now, is_gate_closed)
        self.liveness = EngineLiveness(now=now, pool_stall_timeout_s=pool_stall_timeout_s)
        self.requests: dict[str, RequestRecord] = {}
        self.endured_prefills = 0  # the sum of its decoding requests' `prefills_endured`
        self._queue = queue  # the gateway's wait queue: what waits there for this engine (backlog_tokens)
        self._sessions = sessions  # the gateway's session table: the sessions bound here (active_sessions)
        self.timers: tuple[TimerHeap[str], TimerHeap[str]] = (TimerHeap(), TimerHeap())

    # --- EngineView --------------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self.slots.in_flight

    @property
    def outstanding_tokens(self) -> int:
        return self.slots.prefill_tokens

    @property
    def decoding(self) -> int:
        return self.slots.decoding

    @property
    def decode_weight(self) -> int:
        return self.slots.decoding + self.endured_prefills

    @property
    def backlog_tokens(self) -> int:
        slots, queue = self.slots, self._queue
        backlog = slots.prefill_tokens + slots.rest_tokens
        if queue is not None:
            backlog += queue.lane_weight((self.engine_id, False)) + queue.lane_weight((self.engine_id, True))
        return backlog

    @property
    def active_sessions(self) -> int:
        return 0 if self._sessions is None else self._sessions.sessions_on(self.engine_id)

    @property
    def session_tokens(self) -> int:
        return 0 if self._sessions is None else self._sessions.tokens_on(self.engine_id)

    def has_room(self) -> bool:
        return self.slots.has_room()

    def can_admit(self, request: PlacementRequest) -> bool:
        return self.slots.can_admit(request.uncached_on(self.engine_id))

    # --- gateway helpers ---------------------------------------------------------------------------------

    @property
    def is_schedulable(self) -> bool:
        return self.state is EngineState.HEALTHY and not self.is_paused and not self.is_draining

    def __repr__(self) -> str:
        paused = " paused" if self.is_paused else ""
        return (
            f"<EngineRecord {self.engine_id} {self.state.value}{paused} "
            f"[{self.slots.in_flight}/{self.slots.capacity:g} in flight]>"  # float: 2.0 compiled (setup.py)
        )
