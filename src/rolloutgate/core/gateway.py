"""The gateway core: events in, commands out, deadlines on request.

Theory of operation
-------------------
`Gateway` is a sans-IO state machine. The driver (server/driver.py) feeds it every event the edges see with the
time they saw it, `handle(event, now) -> [Command]`, executes the returned commands in order, and sleeps until
`next_deadline()`, when it calls `on_time(now)`. The driver must call `on_time` once `now >= next_deadline()`
before handing further events; `handle` never fires timers itself, which keeps the hottest call
(`ProgressReported`, once per upstream chunk) O(1) and allocation-free apart from the (empty) result list.

Composition: the state and the bookkeeping shared by every handler live in `GatewayLedger` (ledger.py), which
this class extends with the public API, the event handlers and the verdicts. Requests wait in a `WaitQueue`
(lanes, O(log n)); the `Dispatcher` chooses what starts where
(placement policy + admission); every request's clocks and budgets live in its `RequestClock` over per-engine
`ChargeMeter`s (request_clock.py, the one home of budget arithmetic); engines are judged by `EngineLiveness`.
All timers are one real-time `TimerHeap` of keys: per engine (charged-time verdicts, liveness), per request (wall
cap, wallclock timeout, client grace), the queue-timeout heap and the no-engine timer. Charged-time verdicts of
an engine's requests are kept in that engine's virtual-time heaps, so a change of the engine's mode (a prefill
starting or ending, a pause) reschedules one key, not every request.

Verdicts (ENGINE clock mode; DESIGN.md is authoritative):
- charged > timeout_s                 -> Abort(TIMEOUT) + Fail(TIMEOUT) with the timing breakdown
- queue > queue_timeout_s             -> Fail(QUEUE_TIMEOUT, retry_after)
- wall > max_wall_s                   -> Abort(MAX_WALL) if dispatched + Fail(MAX_WALL)
- engine says it paused itself (EnginePaused unannounced) -> its silence since its last progress is paused
- engine silent for its stall window (at least warmup_timeout_s before its first progress since it joined
  or was last marked unhealthy: a compile is not a hang, liveness.py "Warm-up")
                                      -> CheckEngine (is it paused?) hang_check_s before the window ends,
  then, still silent at its end, MarkEngine(quarantined), Abort(ENGINE_HUNG) + re-queue at the front
  (requests pinned to that engine fail with NO_ENGINE, as when their engine leaves; while their engine is
  merely unhealthy or paused they wait)
- request stuck alone (no progress for its stall_timeout of charged time while its engine progressed on
  others, within the last stall_recheck_s) -> Abort(STUCK) + re-queue once avoiding that engine; stuck
  again -> Fail(STALL)
- retryable UpstreamFailed            -> re-queue avoiding that engine, up to max_attempts, then
  Fail(ATTEMPTS_EXHAUSTED); not retryable -> Fail(UPSTREAM); `engine_unreachable` -> MarkEngine(unhealthy);
  `engine_lost` (the engine dropped the call) while the request was in prefill, the second time
  (POISON_PREFILL_LOSSES) -> Fail(ENGINE_LOST_IN_PREFILL): a request that two engines died prefilling is not
  sent to kill a third
- client gone for retry_grace_s       -> Abort(CLIENT_GONE) if dispatched, forgotten (no Fail: no client)
- its group aborted (GroupAborted)    -> Abort(GROUP_ABORTED) if dispatched + Fail(ABORTED), each live member;
  a group's last member ending        -> RecordGroup (its outcome and completion time, group_table.py)
- no healthy engine for no_engine_grace_s -> queued Fail(NO_ENGINE, retry_after), new ones fail at once
- running past max_staleness at a weight update -> Abort(STALE) + re-queue from scratch, or
  Abort(STALE_PARTIAL): its engine answers it with its partial output (weights.py)

WALLCLOCK clock mode reproduces the incident's proxy: no admission limit (capacity and prefill budget are
infinite, so everything is dispatched at once to the least outstanding engine), the timeout counts wall time
from arrival and fails the request without an Abort command (the edge still closes the call's connection as it
fails it, which the engine notices within a few seconds and aborts: what the miles router does with its timeout
set), no stall or hung detection, and a client disconnect does nothing. Everything else (gate, queue limits, failures, max_wall) is the same.

Rules:
1. Every request ends exactly once: Complete, Fail, or forgotten after its client left; its record, queue
   entry and timers are freed then (stats return to zero when idle).
2. Events for unknown requests (ended, forgotten) or for a stale attempt are ignored: the edge races the core.
3. Commands are returned in the order to execute: aborts before the failures they cause, dispatches last.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rolloutgate.core.commands import (
    AbortReason,
    CheckEngine,
    Command,
    Complete,
    FailReason,
    GroupOutcome,
)
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.engine_state import EngineState
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
    Event,
    GateClosed,
    GateOpened,
    GroupAborted,
    PauseMode,
    ProgressReported,
    QueueAborted,
    RequestArrived,
    SessionEnded,
    UpstreamFailed,
    UpstreamFinished,
    WeightsUpdated,
)
from rolloutgate.core.ledger import CHARGE_CLASSES, GatewayLedger, TimerKind
from rolloutgate.core.records import EngineRecord, RequestRecord
from rolloutgate.core.request_clock import EPSILON_S, ChargeClass
from rolloutgate.core.request_state import RequestState
from rolloutgate.core.stats import EngineStats, GatewayStats
from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.core.wait_queue import SHARED

__all__ = ("POISON_PREFILL_LOSSES", "Gateway", "GatewayCoreConfig")

# An engine that dies drops every call on it, and the ones it was prefilling may be what killed it (an input its
# model cannot embed, a prompt that exhausts its memory). Once is no proof: an engine restarted, killed for
# memory or lost with its node drops its prefills too, and those must move like the rest. Twice is: a request two
# engines died prefilling fails rather than go on to kill a third and every request there with it.
POISON_PREFILL_LOSSES = 2


class Gateway(GatewayLedger):
    """The sans-IO gateway core; see the module docstring."""

    def __init__(self, config: GatewayCoreConfig) -> None:
        super().__init__(config)
        self._handlers: dict[type, Callable[[Any, float], list[Command]]] = {
            RequestArrived: self._on_arrived,
            ProgressReported: self._on_progress,
            UpstreamFinished: self._on_finished,
            UpstreamFailed: self._on_upstream_failed,
            ClientDisconnected: self._on_disconnected,
            ClientAttached: self._on_attached,
            EngineJoined: self._on_engine_joined,
            EngineLeft: self._on_engine_left,
            EngineDraining: self._on_engine_draining,
            EngineHealthChecked: self._on_health_checked,
            EngineCacheFlushed: self._on_cache_flushed,
            EnginePaused: self._on_engine_paused,
            EngineResumed: self._on_engine_resumed,
            QueueAborted: self._on_queue_aborted,
            GroupAborted: self._on_group_aborted,
            SessionEnded: self._on_session_ended,
            GateClosed: self._on_gate_closed,
            GateOpened: self._on_gate_opened,
            WeightsUpdated: self._on_weights_updated,
        }

    # --- public API ----------------------------------------------------------------------------------------

    def handle(self, event: Event, now: float, *, defer_deadlines: bool = False) -> list[Command]:
        """Apply one event at time `now`; return the commands to execute, in order.

        The real-time deadlines the event moved are recomputed before the call returns, or, with
        `defer_deadlines`, at the next `flush_deadlines` (see there).
        Raises ValueError for a `RequestArrived` whose id is still live (the edge must use unique ids).
        """
        out = self._handlers[type(event)](event, now)
        if self._dirty and not defer_deadlines:
            self._flush_deadlines(now)
        return out

    def flush_deadlines(self, now: float) -> None:
        """Recompute the real-time deadlines of the engines that events handled with `defer_deadlines` touched.

        An edge that handles many events at once (an event loop's iteration) recomputes each engine's
        deadlines once for all of them instead of once per event. Until it does, `next_deadline()` may be
        earlier than the truth (harmless: every verdict is checked again when its timer fires, and re-armed if
        it is not due) or later by as long as the flush is deferred: the edge flushes within the same
        iteration."""
        if self._dirty:
            self._flush_deadlines(now)

    def on_time(self, now: float) -> list[Command]:
        """Fire every deadline that has passed by `now`; return the resulting commands."""
        out: list[Command] = []
        timers = self._timers
        while (key := timers.pop_due(now)) is not None:
            kind, ident = key
            if kind == TimerKind.CHARGE:
                self._fire_charge(ident, now, out)
            elif kind == TimerKind.LIVE:
                self._fire_liveness(ident, now, out)
            elif kind == TimerKind.QUEUE:
                self._fire_queue(now, out)
            elif kind == TimerKind.NO_ENGINE:
                self._fire_no_engine(now, out)
            elif kind == TimerKind.REST:
                self._engines[ident].slots.end_rest()  # the pump below may start its next prefill
            else:
                r = self._requests[ident]
                if kind == TimerKind.WALL:
                    abort = AbortReason.MAX_WALL if r.engine is not None else None
                    self._fail(r, FailReason.MAX_WALL, now, out, abort=abort)
                elif kind == TimerKind.WALLCLOCK:
                    self._fail(r, FailReason.TIMEOUT, now, out, detail="wall time since arrival")
                else:
                    self._forget(r, now, out)
            self._flush_deadlines(now)
        self._pump(now, out)
        self._flush_deadlines(now)
        return out

    def next_deadline(self) -> float:
        """The earliest time `on_time` has something to do (math.inf if none)."""
        return self._timers.next_at()

    def timing(self, request_id: str, now: float) -> TimingBreakdown:
        """The live timing breakdown of a request. Raises KeyError if it is unknown or has ended."""
        return self._breakdown(self._requests[request_id], now)

    def oldest_queued_s(self, now: float) -> float:
        """The longest queue time (the queue clock: time the gate was closed is not counted) of the requests
        waiting now; 0.0 when none waits. O(waiting requests): read at scrape time, not on the hot path."""
        requests = self._requests
        return max((requests[rid].clock.queue_s(now) for rid in self._queue), default=0.0)

    def group_members(self, group: str) -> tuple[str, ...]:
        """The group's live members (request ids, in arrival order); empty once it has ended."""
        return self._groups.members(group)

    def session_placement(self, routing_key: str) -> tuple[str, int] | None:
        """Where the session's prefix is believed to live: (engine id, cached prompt tokens), or None."""
        return self._sessions.get(routing_key)

    def engine_state(self, engine_id: str) -> str | None:
        """The engine's state (an EngineState value), or None if the core does not know the engine."""
        engine = self._engines.get(engine_id)
        return None if engine is None else engine.state.value

    def in_flight_on(self, engine_id: str) -> int:
        """The calls running on the engine (0 if the core does not know it)."""
        engine = self._engines.get(engine_id)
        return 0 if engine is None else engine.in_flight

    def stats(self) -> GatewayStats:
        waiting: dict[str, int] = {}
        for lane in self._queue.engine_lanes():
            waiting[lane[0]] = waiting.get(lane[0], 0) + len(self._queue.ids_in_lane(lane))
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
                hung_at=self._hung_at(e),
            )
            for e in self._engines.values()
        )
        return GatewayStats(
            clock_mode=self._config.clock_mode.value,
            gate="open" if self._gate.mode is None else self._gate.mode.value,
            gate_closed_at=self._gate.closed_at,
            queue_depth=len(self._queue),
            in_flight={e.engine_id: e.in_flight for e in self._engines.values()},
            engine_states={e.engine_id: e.state.value for e in self._engines.values()},
            live_requests=len(self._requests),
            engines=engines,
            pending_timers=len(self._timers)
            + len(self._queue_timers)
            + sum(len(t) for e in self._engines.values() for t in e.timers),
            sessions=len(self._sessions),
            fails=dict(self._fails),
            aborts=dict(self._aborts),
            weight_version=self._weights.version,
            engine_weight_version=self._weights.engine_version,
            stale_requeued=self._weights.stale_requeued,
            stale_partial=self._weights.stale_partial,
            **self._counts,
        )

    def __repr__(self) -> str:
        busy = sum(1 for e in self._engines.values() if e.in_flight)
        in_flight = sum(e.in_flight for e in self._engines.values())
        gate = "open" if self._gate.mode is None else f"closed ({self._gate.mode.value})"
        return (
            f"<Gateway {self._config.clock_mode.value}-clock [{len(self._queue)} queued, {in_flight} in flight "
            f"on {busy}/{len(self._engines)} engines, gate {gate}]>"
        )

    # --- requests ----------------------------------------------------------------------------------------

    def _on_arrived(self, ev: RequestArrived, now: float) -> list[Command]:
        if ev.request_id in self._requests:
            raise ValueError(f"request {ev.request_id!r} is already live")
        self._seq += 1
        self._counts["arrived"] += 1
        r = RequestRecord(ev, seq=self._seq, now=now)
        out: list[Command] = []
        if self._healthy == 0 and self._no_healthy_since_at is None:
            self._start_no_engine_grace(now)
        if self._is_failing_fast(now):
            self._reject(
                r, FailReason.NO_ENGINE, now, out, self._config.no_engine_retry_after_s, "no healthy engine"
            )
        elif ev.pinned_engine is not None and ev.pinned_engine not in self._engines:
            self._reject(
                r, FailReason.NO_ENGINE, now, out, self._config.no_engine_retry_after_s, "unknown engine"
            )
        elif len(self._queue) >= self._config.max_queue:
            self._reject(r, FailReason.QUEUE_FULL, now, out, self._config.retry_after_s, "queue full")
        else:
            self._requests[r.request_id] = r
            if r.group is not None:
                self._groups.join(r.group, r.request_id, now)
            engine = self._direct_engine(r)
            if engine is None:
                self._enqueue(r, now)
            else:
                r.move_to(RequestState.QUEUED)  # through the queue in no time (no queue time, no timer)
            if r.limits.max_wall_s != math.inf:
                self._timers.set(
                    (TimerKind.WALL, r.request_id), r.clock.wall_deadline_at(r.limits.max_wall_s)
                )
            if not self._is_engine_mode:
                self._timers.set((TimerKind.WALLCLOCK, r.request_id), r.clock.wallclock_deadline_at())
            if engine is None:
                self._pump(now, out)
            else:
                self._dispatch(r, engine, now, out)
        return out

    def _direct_engine(self, r: RequestRecord) -> EngineRecord | None:
        """The engine a request arriving at an empty queue starts on at once (`Dispatcher.place_arrival`),
        else None: it is queued and the pump decides. Most arrivals find the queue empty; this skips the
        queue's bookkeeping and the general decision loop for them (the same decision, tested)."""
        if not self._config.direct_arrivals or self._queue or self._gate.is_closed or not self._schedulable:
            return None
        return self._dispatcher.place_arrival(r, self._schedulable)

    def _on_progress(self, ev: ProgressReported, now: float) -> list[Command]:
        r = self._requests.get(ev.request_id)
        if r is None:
            return []
        engine = r.engine
        if engine is None or (ev.attempt is not None and ev.attempt != r.attempt):
            return []
        r.tokens += ev.tokens
        if not ev.engine_level:  # an engine-level share is an estimate; the request's own output follows
            engine.generated_tokens += ev.tokens
            engine.liveness.last_token_at = now
        engine.liveness.last_progress_at = now
        if r.is_in_prefill:
            if ev.engine_level and now < r.prefill_due_at:
                return []  # its engine progresses; its own prefill may still be running
            return self._end_prefill(r, engine, now)
        r.clock.note_progress(now)
        return []

    def _end_prefill(self, r: RequestRecord, engine: EngineRecord, now: float) -> list[Command]:
        """First progress of an attempt: its prefill is over (budget freed, contention may end)."""
        r.move_to(RequestState.STREAMING)
        r.is_in_prefill = False
        rest_until_at = engine.slots.finish_prefill(r.uncached_tokens, now)
        if rest_until_at != math.inf:
            self._timers.set((TimerKind.REST, engine.engine_id), rest_until_at)
        if r.is_large_prefill:
            self._note_prefill_endured(r, engine)
            r.is_large_prefill = False
            engine.meter.remove_large_prefill(now)
            engine.liveness.large_prefill_tokens -= r.uncached_tokens
            if self._is_engine_mode:
                engine.timers[ChargeClass.SOLO].discard(r.request_id)
            r.clock.switch_class(ChargeClass.FREE, now)
        r.clock.note_progress(now)
        if self._is_engine_mode:
            self._arm_request(r, engine)
            self._touch(engine)
        out: list[Command] = []
        if engine.slots.prefill_token_budget != math.inf:
            self._pump(now, out)  # prefill budget freed: something may fit now
        return out

    @staticmethod
    def _note_prefill_endured(prefilled: RequestRecord, engine: EngineRecord) -> None:
        """Every decode on the engine sat through `prefilled`'s long prefill: placement weighs them by it.

        O(requests there), once per long prefill (rare next to progress events)."""
        endured = 0
        for q in engine.requests.values():
            if q is not prefilled and not q.is_in_prefill:
                q.prefills_endured += 1
                endured += 1
        engine.endured_prefills += endured

    def _on_finished(self, ev: UpstreamFinished, now: float) -> list[Command]:
        r = self._requests.get(ev.request_id)
        if r is None or r.engine is None or (ev.attempt is not None and ev.attempt != r.attempt):
            return []
        self._sessions.grow(r.routing_key, r.engine.engine_id, r.prompt_tokens + r.tokens)
        engine_id = r.engine.engine_id
        self._detach(r, now)
        r.move_to(RequestState.DONE)
        r.clock.finish(now)
        out: list[Command] = [Complete(request_id=r.request_id, timing=self._breakdown(r, now, engine_id))]
        self._counts["completed"] += 1
        self._leave_group(r, GroupOutcome.FINISHED, now, out)
        self._free(r)
        self._pump(now, out)
        return out

    def _on_upstream_failed(self, ev: UpstreamFailed, now: float) -> list[Command]:
        r = self._requests.get(ev.request_id)
        engine = None if r is None else r.engine
        if r is None or engine is None or (ev.attempt is not None and ev.attempt != r.attempt):
            return []
        out: list[Command] = []
        if ev.engine_unreachable and engine.state is EngineState.HEALTHY:
            self._mark(engine, EngineState.UNHEALTHY, now, out, ev.reason)
        if ev.engine_lost and r.is_in_prefill:
            r.prefill_losses += 1
        self._detach(r, now, forgive=ev.retryable)
        detail = ev.reason if ev.status is None else f"{ev.reason} (status {ev.status})"
        if not ev.retryable:
            self._fail(r, FailReason.UPSTREAM, now, out, detail=detail)
        elif r.prefill_losses >= POISON_PREFILL_LOSSES:
            self._fail(r, FailReason.ENGINE_LOST_IN_PREFILL, now, out, detail=detail)
        elif r.fault_attempts >= self._config.max_attempts:
            self._fail(r, FailReason.ATTEMPTS_EXHAUSTED, now, out, detail=detail)
        else:
            self._retry(r, engine, now)
        self._pump(now, out)
        return out

    def _on_disconnected(self, ev: ClientDisconnected, now: float) -> list[Command]:
        r = self._requests.get(ev.request_id)
        if r is None or not self._is_engine_mode:
            return []
        r.is_disconnected = True
        out: list[Command] = []
        key = (TimerKind.GRACE, r.request_id)
        if self._config.retry_grace_s == 0:
            self._forget(r, now, out)
            self._pump(now, out)
        elif key not in self._timers:  # a repeated disconnect keeps the first deadline
            self._timers.set(key, now + self._config.retry_grace_s)
        return out

    def _on_attached(self, ev: ClientAttached, now: float) -> list[Command]:
        r = self._requests.get(ev.request_id)
        if r is not None:
            r.is_disconnected = False
            self._timers.discard((TimerKind.GRACE, r.request_id))
        return []

    # --- engines -----------------------------------------------------------------------------------------

    def _on_engine_joined(self, ev: EngineJoined, now: float) -> list[Command]:
        capacity = ev.capacity if self._is_engine_mode else math.inf
        budget = ev.prefill_token_budget if self._is_engine_mode else math.inf
        out: list[Command] = []
        engine = self._engines.get(ev.engine_id)
        if engine is None:
            self._engine_seq += 1
            engine = EngineRecord(
                engine_id=ev.engine_id,
                order=self._engine_seq,
                now=now,
                capacity=capacity,
                prefill_token_budget=budget,
                is_healthy=ev.healthy,
                is_gate_closed=self._gate.is_closed,
                pool_stall_timeout_s=self._config.engine_stall_timeout_s,
                budget_exempt_tokens=self._config.prefill_budget_exempt_tokens,
                rest_ratio=self._config.prefill_rest_ratio,
                queue=self._queue,
                sessions=self._sessions,
            )
            self._engines[ev.engine_id] = engine
        else:  # a re-probe: new limits, and its health as a health check
            engine.slots.capacity = capacity
            engine.slots.prefill_token_budget = budget
            self._apply_health(engine, ev.healthy, now, out)
        self._refresh_engines(now)
        self._pump(now, out)
        return out

    def _on_engine_left(self, ev: EngineLeft, now: float) -> list[Command]:
        engine = self._engines.get(ev.engine_id)
        if engine is None:
            return []
        out: list[Command] = []
        for r in sorted(engine.requests.values(), key=lambda r: r.sort_key):
            self._abort(r, AbortReason.ENGINE_LEFT, out)
            self._detach(r, now, forgive=True)
            if r.pinned_engine == engine.engine_id:
                self._fail(r, FailReason.NO_ENGINE, now, out, detail="its engine left the pool")
            else:
                self._requeue(r, now)
        self._fail_pinned_waiters(engine.engine_id, now, out, "its engine left the pool")
        for rid in self._queue.ids_in_lane((engine.engine_id, False)):
            self._queue.move(rid, SHARED)
        del self._engines[ev.engine_id]
        self._timers.discard((TimerKind.CHARGE, engine.engine_id))
        self._timers.discard((TimerKind.LIVE, engine.engine_id))
        self._timers.discard((TimerKind.REST, engine.engine_id))
        self._refresh_engines(now)
        self._pump(now, out)
        return out

    def _on_engine_draining(self, ev: EngineDraining, now: float) -> list[Command]:
        engine = self._engines.get(ev.engine_id)
        if engine is None or engine.is_draining == ev.draining:
            return []
        out: list[Command] = []
        engine.is_draining = ev.draining
        if ev.draining:  # what waits for it goes to the shared queue; its running calls stay
            self._fail_pinned_waiters(engine.engine_id, now, out, "its engine is being handed over")
            for rid in self._queue.ids_in_lane((engine.engine_id, False)):
                self._queue.move(rid, SHARED)
        self._refresh_engines(now)
        self._pump(now, out)
        return out

    def _on_health_checked(self, ev: EngineHealthChecked, now: float) -> list[Command]:
        engine = self._engines.get(ev.engine_id)
        out: list[Command] = []
        if engine is not None:
            self._apply_health(engine, ev.healthy, now, out)
            self._refresh_engines(now)
            self._pump(now, out)
        return out

    def _apply_health(self, engine: EngineRecord, healthy: bool, now: float, out: list[Command]) -> None:
        if healthy and engine.state is not EngineState.HEALTHY:
            self._mark(engine, EngineState.HEALTHY, now, out, "health check passed")
        elif not healthy and engine.state is EngineState.HEALTHY:
            self._mark(engine, EngineState.UNHEALTHY, now, out, "health check failed")

    def _on_engine_paused(self, ev: EnginePaused, now: float) -> list[Command]:
        engine = self._engines.get(ev.engine_id)
        if engine is not None and not engine.is_paused:
            engine.is_paused = True
            if ev.unannounced:  # it paused itself after its last progress: its silence is the pause's
                since = engine.liveness.silent_since_at(ev.last_output_at)
                since = engine.meter.backdate_pause(since, now)
                for r in engine.requests.values():
                    r.clock.rebase(since, now)
            else:
                engine.meter.set_paused(now, True)
            self._touch(engine)
            self._refresh_engines(now)
        return []

    def _on_cache_flushed(self, ev: EngineCacheFlushed, now: float) -> list[Command]:
        # Only the placement's estimate changes; nothing in flight or queued moves because of it.
        self._sessions.forget_cached(ev.engine_id)
        return []

    def _on_engine_resumed(self, ev: EngineResumed, now: float) -> list[Command]:
        engine = self._engines.get(ev.engine_id)
        out: list[Command] = []
        if engine is not None and engine.is_paused:
            engine.is_paused = False
            engine.meter.set_paused(now, self._gate.is_closed)
            engine.liveness.note_resumed(now)
            self._touch(engine)
            self._refresh_engines(now)
            self._pump(now, out)
        return out

    def _on_queue_aborted(self, ev: QueueAborted, now: float) -> list[Command]:
        out: list[Command] = []
        for request_id in self._queue.ids_in_order():
            if ev.request_ids is not None and request_id not in ev.request_ids:
                continue
            self._fail(self._requests[request_id], FailReason.ABORTED, now, out, detail="abort_request")
        return out

    def _on_group_aborted(self, ev: GroupAborted, now: float) -> list[Command]:
        out: list[Command] = []
        for request_id in self._groups.members(ev.group):
            r = self._requests[request_id]
            abort = AbortReason.GROUP_ABORTED if r.engine is not None else None
            self._fail(r, FailReason.ABORTED, now, out, abort=abort, detail="its group was aborted")
        self._pump(now, out)  # their slots are free
        return out

    def _on_session_ended(self, ev: SessionEnded, now: float) -> list[Command]:
        # Only the placement's memory changes: the session's calls still in flight or queued run on.
        self._sessions.release(ev.routing_key)
        return []

    # --- the gate ----------------------------------------------------------------------------------------

    def _on_gate_closed(self, ev: GateClosed, now: float) -> list[Command]:
        self._gate.close(ev.mode, now)
        self._pool.set_paused(now, True)
        self._timers.discard((TimerKind.QUEUE, ""))
        out: list[Command] = []
        in_flight = [r for e in self._engines.values() for r in e.requests.values()]
        for engine in self._engines.values():
            engine.meter.set_paused(now, True)
            self._touch(engine)
        if ev.mode is PauseMode.ABORT:
            for r in sorted(in_flight, key=lambda r: r.sort_key):
                self._abort(r, AbortReason.REQUEUE, out)
                self._detach(r, now)
                self._requeue(r, now)
        return out

    def _on_gate_opened(self, ev: GateOpened, now: float) -> list[Command]:
        out: list[Command] = []
        if not self._gate.open():
            return out
        self._pool.set_paused(now, False)
        self._reschedule_queue(now)
        for engine in self._engines.values():
            engine.meter.set_paused(now, engine.is_paused)
            engine.liveness.note_resumed(now)
            self._touch(engine)
        self._pump(now, out)
        return out

    def _on_weights_updated(self, ev: WeightsUpdated, now: float) -> list[Command]:
        """One more weight version; what runs past the staleness bound ends its attempt (weights.py)."""
        weights = self._weights
        out: list[Command] = []
        weights.advance(ev.engine_version)
        running = [r for e in self._engines.values() for r in e.requests.values()]
        for r in sorted(running, key=lambda r: r.sort_key):
            if r.is_stale_answering or not weights.is_stale(r.started_version):
                continue
            if self._config.on_stale == "partial":  # its engine answers it with what it generated so far
                self._abort(r, AbortReason.STALE_PARTIAL, out)
                r.is_stale_answering = True
                weights.stale_partial += 1
            else:
                self._abort(r, AbortReason.STALE, out)
                self._detach(r, now, forgive=True)
                self._requeue(r, now)
                weights.stale_requeued += 1
        self._pump(now, out)
        return out

    # --- verdicts ------------------------------------------------------------------------------------------

    def _fire_charge(self, engine_id: str, now: float, out: list[Command]) -> None:
        engine = self._engines[engine_id]
        meter = engine.meter
        while True:
            due = None
            for cls in CHARGE_CLASSES:
                if (
                    meter.is_running(cls)
                    and engine.timers[cls].next_at() <= meter.value(cls, now) + EPSILON_S
                ):
                    due = cls
                    break
            if due is None:
                break
            rid = engine.timers[due].pop_due(math.inf)
            assert rid is not None
            self._judge(self._requests[rid], engine, meter.value(due, now) + EPSILON_S, now, out)
        self._touch(engine)

    def _judge(
        self, r: RequestRecord, engine: EngineRecord, v_now: float, now: float, out: list[Command]
    ) -> None:
        """A request's virtual deadline came: timed out, stuck, or not yet (re-arm)."""
        clock = r.clock
        timeout_v = clock.timeout_v()
        if timeout_v <= v_now:
            self._fail(
                r, FailReason.TIMEOUT, now, out, abort=AbortReason.TIMEOUT, detail="charged engine time"
            )
            return
        stall_v = clock.stall_v(self._own_prefill_allowance(r))
        if stall_v > v_now:
            engine.timers[clock.charge_class].set(r.request_id, min(timeout_v, stall_v))
        elif self._progresses_without(engine, clock.progress_at, now):
            self._stuck(r, engine, now, out)
        else:
            # the whole engine is silent (for stall_recheck_s at least: one that went silent just after this
            # request, paused or frozen with it, is not "progressing on others"): engine liveness decides,
            # with its pause check; look again shortly
            engine.timers[clock.charge_class].set(
                r.request_id, min(timeout_v, v_now + self._config.stall_recheck_s)
            )

    def _progresses_without(self, engine: EngineRecord, since: float, now: float) -> bool:
        """Whether the engine progressed after `since` and is still progressing (within stall_recheck_s)."""
        last = engine.liveness.last_progress_at
        return last > since and last >= now - self._config.stall_recheck_s

    def _stuck(self, r: RequestRecord, engine: EngineRecord, now: float, out: list[Command]) -> None:
        self._abort(r, AbortReason.STUCK, out)
        self._detach(r, now, forgive=True)
        if r.stuck_count or r.fault_attempts >= self._config.max_attempts:
            self._fail(r, FailReason.STALL, now, out, detail="no progress while its engine progressed")
        else:
            r.stuck_count += 1
            self._retry(r, engine, now)

    def _fire_liveness(self, engine_id: str, now: float, out: list[Command]) -> None:
        engine = self._engines[engine_id]
        due_at = self._silence_due_at(engine)
        check_s = self._config.hang_check_s
        if check_s > 0 and due_at - check_s <= now and engine.liveness.ask_check(now):
            out.append(CheckEngine(engine_id=engine_id))  # someone else may have paused it: ask first
        step_at = engine.liveness.next_step_at(due_at, check_s)
        if step_at > now:
            self._timers.set((TimerKind.LIVE, engine_id), step_at)
            return
        silent_s = now - engine.liveness.silent_since_at()
        self._counts["quarantined"] += 1
        self._mark(engine, EngineState.QUARANTINED, now, out, f"no progress for {silent_s:.1f}s")
        for r in sorted(engine.requests.values(), key=lambda r: r.sort_key):
            self._abort(r, AbortReason.ENGINE_HUNG, out)
            self._detach(r, now, forgive=True)
            if r.pinned_engine == engine_id:
                self._fail(r, FailReason.NO_ENGINE, now, out, detail="its engine hung")
            elif r.fault_attempts >= self._config.max_attempts:
                self._fail(r, FailReason.ATTEMPTS_EXHAUSTED, now, out, detail="its engine hung")
            else:
                self._retry(r, engine, now)
        self._fail_pinned_waiters(engine_id, now, out, "its engine hung")

    def _fire_queue(self, now: float, out: list[Command]) -> None:
        limit = self._pool.value(ChargeClass.FREE, now) + EPSILON_S
        while (rid := self._queue_timers.pop_due(limit)) is not None:
            r = self._requests[rid]
            self._fail(r, FailReason.QUEUE_TIMEOUT, now, out, retry_after_s=self._config.retry_after_s)
        self._reschedule_queue(now)

    # --- engine bookkeeping --------------------------------------------------------------------------------
