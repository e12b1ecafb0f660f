"""The gateway core: events in, commands out, deadlines on request.

Theory of operation
-------------------
`Gateway` is a sans-IO state machine. The driver (server/driver.py) feeds it every event the edges see with the
time they saw it, `handle(event, now) -> [Command]`, executes the returned commands in order, and sleeps until
`next_deadline()`, when it calls `on_time(now)`. The driver must call `on_time` once `now >= next_deadline()`
before handing further events; `handle` never fires timers itself, which keeps the hottest call
(`ProgressReported`, once per upstream chunk) O(1) and allocation-free apart from the (empty) result list.

Composition: the gateway holds one `Ledger` (ledger.py: the state, and the bookkeeping that keeps it
consistent) and routes each event to its handler, a plain function of the ledger, by the event's type (the table
in `Gateway.__init__`): requests in on_requests.py, engines in on_engines.py, the gate and weight updates in
on_gate.py. Each due timer goes to verdicts.py, which also recomputes the real-time deadlines of the engines an
event touched. The verdicts are listed where they are made (verdicts.py, on_requests.py, on_engines.py,
on_gate.py); DESIGN.md is authoritative. `inspect()` shows the state read-only (view.py); `stats()` counts it.

WALLCLOCK clock mode reproduces the incident's proxy: no admission limit (capacity and prefill budget are
infinite, so everything is dispatched at once to the least outstanding engine), the timeout counts wall time
from arrival and fails the request without an Abort command (the edge still closes the call's connection as it
fails it, which the engine notices within a few seconds and aborts: what the miles router does with its timeout
set), no stall or hung detection, and a client disconnect does nothing. Everything else (gate, queue limits,
failures, max_wall) is the same.

Rules:
1. Every request ends exactly once: Complete, Fail, or forgotten after its client left; its record, queue
   entry and timers are freed then (stats return to zero when idle; ledger.py rule 1).
2. Events for unknown requests (ended, forgotten) or for a stale attempt are ignored: the edge races the core.
3. Commands are returned in the order to execute: aborts before the failures they cause, dispatches last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rolloutgate.core.commands import Command
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import (
    ClientAttached,
    ClientDisconnected,
    EngineCacheFlushed,
    EngineDraining,
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    EnginePaused,
    EngineResumed,
    EngineVersionLag,
    Event,
    GateClosed,
    GateOpened,
    GroupAborted,
    ProgressReported,
    QueueAborted,
    RequestArrived,
    SessionEnded,
    UpstreamFailed,
    UpstreamFinished,
    WeightsUpdated,
)
from rolloutgate.core.ledger import Ledger
from rolloutgate.core.on_engines import (
    on_cache_flushed,
    on_engine_draining,
    on_engine_joined,
    on_engine_left,
    on_engine_paused,
    on_engine_resumed,
    on_engine_version_lag,
    on_health_checked,
)
from rolloutgate.core.on_gate import on_gate_closed, on_gate_opened, on_weights_updated
from rolloutgate.core.on_requests import (
    POISON_PREFILL_LOSSES,
    on_arrived,
    on_attached,
    on_disconnected,
    on_finished,
    on_group_aborted,
    on_progress,
    on_queue_aborted,
    on_session_ended,
    on_upstream_failed,
)
from rolloutgate.core.stats import EngineStats, GatewayStats
from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.core.verdicts import fire, flush_deadlines, hung_at
from rolloutgate.core.view import GatewayView, view_of

__all__ = ("POISON_PREFILL_LOSSES", "Gateway", "GatewayCoreConfig")

_Handler = Callable[[Ledger, Any, float], list[Command]]


class Gateway:
    """The sans-IO gateway core; see the module docstring."""

    def __init__(self, config: GatewayCoreConfig) -> None:
        self._ledger = Ledger(config)
        self._handlers: dict[type, _Handler] = {
            RequestArrived: on_arrived,
            ProgressReported: on_progress,
            UpstreamFinished: on_finished,
            UpstreamFailed: on_upstream_failed,
            ClientDisconnected: on_disconnected,
            ClientAttached: on_attached,
            EngineJoined: on_engine_joined,
            EngineLeft: on_engine_left,
            EngineDraining: on_engine_draining,
            EngineVersionLag: on_engine_version_lag,
            EngineHealthChecked: on_health_checked,
            EngineCacheFlushed: on_cache_flushed,
            EnginePaused: on_engine_paused,
            EngineResumed: on_engine_resumed,
            QueueAborted: on_queue_aborted,
            GroupAborted: on_group_aborted,
            SessionEnded: on_session_ended,
            GateClosed: on_gate_closed,
            GateOpened: on_gate_opened,
            WeightsUpdated: on_weights_updated,
        }

    # --- public API ----------------------------------------------------------------------------------------

    def handle(self, event: Event, now: float, *, defer_deadlines: bool = False) -> list[Command]:
        """Apply one event at time `now`; return the commands to execute, in order.

        The real-time deadlines the event moved are recomputed before the call returns, or, with
        `defer_deadlines`, at the next `flush_deadlines` (see there).
        Raises ValueError for a `RequestArrived` whose id is still live (the edge must use unique ids).
        """
        ledger = self._ledger
        out = self._handlers[type(event)](ledger, event, now)
        if ledger.has_released:  # a session's held call entered the queue (session_cap.py): it may start now
            ledger.pump(now, out)
        if ledger.dirty and not defer_deadlines:
            flush_deadlines(ledger, now)
        return out

    def flush_deadlines(self, now: float) -> None:
        """Recompute the real-time deadlines of the engines that events handled with `defer_deadlines` touched.

        An edge that handles many events at once (an event loop's iteration) recomputes each engine's
        deadlines once for all of them instead of once per event. Until it does, `next_deadline()` may be
        earlier than the truth (harmless: every verdict is checked again when its timer fires, and re-armed if
        it is not due) or later by as long as the flush is deferred: the edge flushes within the same
        iteration."""
        if self._ledger.dirty:
            flush_deadlines(self._ledger, now)

    def on_time(self, now: float) -> list[Command]:
        """Fire every deadline that has passed by `now`; return the resulting commands."""
        ledger = self._ledger
        out: list[Command] = []
        timers = ledger.timers
        while (key := timers.pop_due(now)) is not None:
            fire(ledger, key[0], key[1], now, out)
            flush_deadlines(ledger, now)
        ledger.pump(now, out)
        flush_deadlines(ledger, now)
        return out

    def next_deadline(self) -> float:
        """The earliest time `on_time` has something to do (math.inf if none)."""
        return self._ledger.timers.next_at()

    def timing(self, request_id: str, now: float) -> TimingBreakdown:
        """The live timing breakdown of a request. Raises KeyError if it is unknown or has ended."""
        return self._ledger.breakdown(self._ledger.requests[request_id], now)

    def oldest_queued_s(self, now: float) -> float:
        """The longest queue time (the queue clock: time the gate was closed is not counted) of the requests
        waiting now; 0.0 when none waits. O(waiting requests): read at scrape time, not on the hot path."""
        requests = self._ledger.requests
        return max((requests[rid].clock.queue_s(now) for rid in self._ledger.queue), default=0.0)

    def group_members(self, group: str) -> tuple[str, ...]:
        """The group's live members (request ids, in arrival order); empty once it has ended."""
        return self._ledger.groups.members(group)

    def session_placement(self, routing_key: str) -> tuple[str, int] | None:
        """Where the session's prefix is believed to live: (engine id, cached prompt tokens), or None."""
        return self._ledger.sessions.get(routing_key)

    def engine_state(self, engine_id: str) -> str | None:
        """The engine's state (an EngineState value), or None if the core does not know the engine."""
        engine = self._ledger.engines.get(engine_id)
        return None if engine is None else engine.state.value

    def in_flight_on(self, engine_id: str) -> int:
        """The calls running on the engine (0 if the core does not know it)."""
        engine = self._ledger.engines.get(engine_id)
        return 0 if engine is None else engine.in_flight

    def inspect(self) -> GatewayView:
        """The core's state now, read-only: its requests, engines, queue, timers and gate (view.py). A frozen
        snapshot for tests and debugging, O(requests + timers); the edge reads `stats()`."""
        return view_of(self._ledger)

    def stats(self) -> GatewayStats:
        ledger = self._ledger
        waiting: dict[str, int] = {}
        for lane in ledger.queue.engine_lanes():
            waiting[lane[0]] = waiting.get(lane[0], 0) + len(ledger.queue.ids_in_lane(lane))
        engines = tuple(
            EngineStats(
                engine_id=e.engine_id,
                state=e.state.value,
                is_paused=e.is_paused,
                in_flight=e.in_flight,
                capacity=e.slots.capacity,
                prefill_tokens=e.slots.prefill_tokens,
                large_prefills=e.meter.large_prefills,
                waiting=waiting.get(e.engine_id, 0),
                is_resting=e.slots.is_resting,
                generated_tokens=e.generated_tokens,
                silent_since_at=e.liveness.silent_since_at(),
                hung_at=hung_at(ledger, e),
            )
            for e in ledger.engines.values()
        )
        return GatewayStats(
            clock_mode=ledger.config.clock_mode.value,
            gate="open" if ledger.gate.mode is None else ledger.gate.mode.value,
            gate_closed_at=ledger.gate.closed_at,
            queue_depth=len(ledger.queue) + ledger.held,
            in_flight={e.engine_id: e.in_flight for e in ledger.engines.values()},
            engine_states={e.engine_id: e.state.value for e in ledger.engines.values()},
            live_requests=len(ledger.requests),
            engines=engines,
            pending_timers=len(ledger.timers)
            + len(ledger.queue_timers)
            + sum(len(t) for e in ledger.engines.values() for t in e.timers),
            sessions=len(ledger.sessions),
            fails=dict(ledger.fails),
            aborts=dict(ledger.aborts),
            weight_version=ledger.weights.version,
            engine_weight_version=ledger.weights.engine_version,
            stale_requeued=ledger.weights.stale_requeued,
            stale_partial=ledger.weights.stale_partial,
            **ledger.counts,
        )

    def __repr__(self) -> str:
        ledger = self._ledger
        busy = sum(1 for e in ledger.engines.values() if e.in_flight)
        in_flight = sum(e.in_flight for e in ledger.engines.values())
        gate = "open" if ledger.gate.mode is None else f"closed ({ledger.gate.mode.value})"
        return (
            f"<Gateway {ledger.config.clock_mode.value}-clock [{len(ledger.queue)} queued, {in_flight} in flight "
            f"on {busy}/{len(ledger.engines)} engines, gate {gate}]>"
        )
