"""Observability as values: what `Gateway.stats()` returns.

Theory of operation: the core never logs or exports metrics; the edge reads these frozen snapshots and turns
them into Prometheus series, admin pages and log lines. Counters only grow; gauges (queued, in flight) return to
zero when the gateway is idle (a test checks this: no state leaks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ("EngineStats", "GatewayStats")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    engine_id: str
    state: str  # EngineState value
    is_paused: bool
    in_flight: int
    capacity: float  # math.inf in wallclock mode
    prefill_tokens: int  # uncached prompt tokens in prefill
    large_prefills: int  # prefills that count as contention
    waiting: int  # requests waiting for this engine (pinned or affine lanes)
    is_resting: bool = False  # taking no long prefill for a while after some (admission.py)
    generated_tokens: int = 0  # output tokens its requests reported (a counter)
    silent_since_at: float = -math.inf  # its last progress, or when it became busy or resumed if later
    hung_at: float = math.inf  # when it counts as hung if no progress comes; math.inf while not watched


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayStats:
    clock_mode: str
    gate: str  # "open" or the PauseMode value it is closed in
    gate_closed_at: float  # when it closed (math.inf while open)
    queue_depth: int  # requests waiting in the gateway (all lanes)
    in_flight: Mapping[str, int]  # engine id -> requests dispatched there
    engine_states: Mapping[str, str]  # engine id -> EngineState value
    live_requests: int  # request records held: queued + in flight (ended ones are freed)
    engines: tuple[EngineStats, ...]
    pending_timers: int
    sessions: int
    arrived: int
    dispatched: int
    redispatched: int  # dispatches with attempt > 1
    completed: int
    client_gone: int  # forgotten after the client left (no Fail)
    quarantined: int  # times an engine was caught hung
    fails: Mapping[str, int]  # FailReason value -> count
    aborts: Mapping[str, int]  # AbortReason value -> count
    weight_version: int = 0  # the gateway's count of weight updates (weights.py)
    engine_weight_version: str | None = None  # the engines' label of the last one, when told
    stale_requeued: int = 0  # requests past the staleness bound at an update, re-queued from scratch
    stale_partial: int = 0  # ... answered with their partial output (finish reason abort)

    @property
    def timeouts(self) -> int:
        """Requests ended by a time budget (charged, stall, queue, wall)."""
        return sum(self.fails.get(k, 0) for k in ("timeout", "stall", "queue_timeout", "max_wall"))

    @property
    def in_flight_total(self) -> int:
        return sum(self.in_flight.values())
