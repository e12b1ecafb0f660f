"""The gateway's record of one engine: health, pause, slots, meter, liveness and its requests' timers.

Theory of operation: one `EngineRecord` per engine in the pool, owned by the gateway. It composes the per-engine
parts (admission.EngineSlots, request_clock.ChargeMeter, liveness.EngineLiveness) and two timer heaps, one per
charge class, holding each in-flight request's next virtual deadline (charged timeout or stall check, see
request_clock.py). It is also the read-only `EngineView` that placement policies see.

Rules:
1. Only the gateway mutates a record; policies read it through `EngineView`.
2. `requests` holds exactly the requests dispatched there and not yet ended or moved.
3. `endured_prefills` is the sum of `prefills_endured` over `requests` (kept by the gateway, O(1) per event).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rolloutgate.core.admission import EngineSlots
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.liveness import EngineLiveness
from rolloutgate.core.placement.base import PlacementRequest
from rolloutgate.core.request_clock import ChargeMeter
from rolloutgate.core.timer_heap import TimerHeap
from rolloutgate.core.wait_queue import WaitQueue

if TYPE_CHECKING:
    from rolloutgate.core.request_record import RequestRecord

__all__ = ("EngineRecord",)


class EngineRecord:
    __slots__ = (
        "_queue",
        "endured_prefills",
        "engine_id",
        "is_paused",
        "liveness",
        "meter",
        "order",
        "requests",
        "slots",
        "state",
        "timers",
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
    ) -> None:
        self.engine_id = engine_id
        self.order = order
        self.state = EngineState.HEALTHY if is_healthy else EngineState.UNHEALTHY
        self.is_paused = False
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

    def has_room(self) -> bool:
        return self.slots.has_room()

    def can_admit(self, request: PlacementRequest) -> bool:
        return self.slots.can_admit(request.uncached_on(self.engine_id))

    # --- gateway helpers ---------------------------------------------------------------------------------

    @property
    def is_schedulable(self) -> bool:
        return self.state is EngineState.HEALTHY and not self.is_paused

    def __repr__(self) -> str:
        paused = " paused" if self.is_paused else ""
        return (
            f"<EngineRecord {self.engine_id} {self.state.value}{paused} "
            f"[{self.slots.in_flight}/{self.slots.capacity:g} in flight]>"  # float: 2.0 compiled (_native.py)
        )
