"""The gateway's state and the bookkeeping every event handler and verdict shares.

Theory of operation: `GatewayLedger` holds everything the core knows (request and engine records, the wait
queue, meters, timers, the gate, the session table, counters) and the operations that keep it consistent:
dispatching, taking a request off its engine, re-queueing, ending a request (complete, fail, forget), marking
engines, and recomputing an engine's real-time deadlines from its meter. `Gateway` (gateway.py) is the only
subclass: it adds the public API, the event handlers and the verdicts. The split keeps each module readable;
there is one state, not two.

Rules:
1. Every path that ends a request goes through `_fail`, `_reject`, `_forget` or the completion in gateway.py,
   and every one of them calls `_free` (records, queue entries and timers are released together).
2. `_detach` is the only way a request leaves an engine; it undoes exactly what `_dispatch` did.
3. Real-time timer keys are `(TimerKind, id)`: per engine CHARGE, LIVE and REST, per request WALL, WALLCLOCK
   and GRACE, one QUEUE and one NO_ENGINE key.
"""

from __future__ import annotations

import enum
import math

from rolloutgate.core.commands import (
    Abort,
    AbortReason,
    Command,
    Dispatch,
    Fail,
    FailReason,
    GroupOutcome,
    MarkEngine,
)
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.dispatcher import Dispatcher
from rolloutgate.core.engine_state import EngineState, transition
from rolloutgate.core.events import ClockMode
from rolloutgate.core.gate import Gate
from rolloutgate.core.group_table import GroupTable
from rolloutgate.core.liveness import prefill_allowance_s
from rolloutgate.core.placement import make_policy
from rolloutgate.core.records import FRONT_TIER, NO_ENGINES, EngineRecord, RequestRecord
from rolloutgate.core.request_clock import ChargeClass, ChargeMeter
from rolloutgate.core.request_state import RequestState
from rolloutgate.core.session_table import SessionTable
from rolloutgate.core.timer_heap import TimerHeap
from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.core.wait_queue import WaitQueue
from rolloutgate.core.weights import WeightVersions

__all__ = ("CHARGE_CLASSES", "GatewayLedger", "TimerKind")


class TimerKind(enum.IntEnum):
    """What a real-time timer key `(kind, id)` stands for."""

    CHARGE = 0  # an engine's next charged-time verdict (id: engine)
    LIVE = 1  # an engine's liveness deadline (id: engine)
    QUEUE = 2  # the earliest queue timeout (id: "")
    WALL = 3  # a request's max_wall (id: request)
    WALLCLOCK = 4  # a request's timeout in wallclock mode (id: request)
    GRACE = 5  # a disconnected client's retry grace (id: request)
    NO_ENGINE = 6  # the no-healthy-engine grace (id: "")
    REST = 7  # an engine's rest after its budgeted prefills ends (id: engine; see admission.py)


_TimerKey = tuple[TimerKind, str]
CHARGE_CLASSES = (ChargeClass.FREE, ChargeClass.SOLO)
_TIMED_OUT = frozenset({FailReason.TIMEOUT, FailReason.STALL, FailReason.QUEUE_TIMEOUT, FailReason.MAX_WALL})


class GatewayLedger:
    """State and bookkeeping of the gateway core (see the module docstring)."""

    def __init__(self, config: GatewayCoreConfig) -> None:
        self._config = config
        self._is_engine_mode = config.clock_mode is ClockMode.ENGINE
        self._requests: dict[str, RequestRecord] = {}
        self._engines: dict[str, EngineRecord] = {}
        self._schedulable: list[EngineRecord] = []
        self._healthy = 0
        self._queue = WaitQueue()
        self._pool = ChargeMeter()  # the queue's meter: FREE while the gate is open
        self._queue_timers: TimerHeap[str] = TimerHeap()  # queue deadlines in pool-meter time
        self._timers: TimerHeap[_TimerKey] = TimerHeap()  # real time
        self._gate = Gate()
        self._weights = WeightVersions(config.max_staleness)
        self._sessions = SessionTable(config.max_sessions)
        self._groups = GroupTable()  # live groups (group_table.py); placed through the session table
        placement = config.placement if self._is_engine_mode else "least_outstanding"
        self._dispatcher = Dispatcher(
            queue=self._queue,
            policy=make_policy(
                placement, max_excess=config.affinity_max_excess, cache_tokens=config.engine_cache_tokens
            ),
            sessions=self._sessions,
            is_affine=placement != "least_outstanding",  # the others wait for a session's engine
            max_excess=config.affinity_max_excess,
        )
        self._seq = 0
        self._engine_seq = 0
        self._no_healthy_since_at: float | None = None
        self._counts: dict[str, int] = dict.fromkeys(
            ("arrived", "dispatched", "redispatched", "completed", "client_gone", "quarantined"), 0
        )
        self._fails: dict[str, int] = {}
        self._aborts: dict[str, int] = {}
        self._dirty: dict[str, EngineRecord] = {}  # engines whose real-time deadlines need recomputing

    def _pump(self, now: float, out: list[Command]) -> None:
        """Dispatch whatever can start now (nothing while the gate is closed).

        While failing fast for lack of any healthy engine, whatever is (re-)queued fails instead.
        """
        if not self._queue:
            return
        if self._healthy == 0 and self._is_failing_fast(now):
            self._fire_no_engine(now, out)
            return
        if self._gate.is_closed or not self._schedulable:
            return
        for r, engine in self._dispatcher.decisions(self._requests, self._engines, self._schedulable):
            self._dispatch(r, engine, now, out)

    def _dispatch(self, r: RequestRecord, engine: EngineRecord, now: float, out: list[Command]) -> None:
        rid = r.request_id
        self._drop_queue_timer(rid)
        uncached = self._sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id, r.group)
        if r.group is not None:  # what its siblings' prefill there saves it, beyond its own session's
            alone = self._sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id)
            self._groups.note_saved(r.group, alone - uncached)
        is_large = uncached >= self._config.contention_min_prefill_tokens
        r.uncached_tokens, r.is_in_prefill, r.is_large_prefill = uncached, True, is_large
        r.prefill_due_at = now + uncached / self._config.prefill_floor_tokens_per_s
        was_idle = not engine.requests
        engine.requests[rid] = r
        engine.slots.admit(uncached, now)
        if is_large:
            engine.meter.add_large_prefill(now)
            engine.liveness.large_prefill_tokens += uncached
        engine.liveness.add_request(r.limits.stall_timeout_s)
        if was_idle:
            engine.liveness.note_busy(now)
        r.clock.start_dispatched(engine.meter, ChargeClass.SOLO if is_large else ChargeClass.FREE, now)
        r.move_to(RequestState.DISPATCHED)
        r.engine = engine
        r.attempt += 1
        r.started_version, r.is_stale_answering = self._weights.version, False
        r.avoid_engines = NO_ENGINES
        self._sessions.record(r.routing_key, engine.engine_id, r.prompt_tokens, r.group)
        if self._is_engine_mode:
            self._arm_request(r, engine)
            self._touch(engine)
        self._counts["dispatched"] += 1
        if r.attempt > 1:
            self._counts["redispatched"] += 1
        out.append(
            Dispatch(
                request_id=rid,
                engine_id=engine.engine_id,
                attempt=r.attempt,
                delivered_tokens=r.delivered_tokens,
            )
        )

    def _enqueue(self, r: RequestRecord, now: float) -> None:
        r.move_to(RequestState.QUEUED)
        r.clock.start_queued(self._pool, now)
        self._queue.push(r.request_id, r.sort_key)
        if r.limits.queue_timeout_s != math.inf:
            self._queue_timers.set(r.request_id, r.clock.queue_v(r.limits.queue_timeout_s))
            self._reschedule_queue(now)

    def _requeue(self, r: RequestRecord, now: float) -> None:
        """Put a request that was running back at the front of the queue (it keeps its original order)."""
        r.tier = FRONT_TIER
        r.delivered_tokens = r.tokens if r.streaming else 0
        r.tokens = r.delivered_tokens
        self._enqueue(r, now)

    def _retry(self, r: RequestRecord, engine: EngineRecord, now: float) -> None:
        r.fault_attempts += 1
        r.avoid_engines = frozenset({engine.engine_id})
        self._requeue(r, now)

    def _detach(self, r: RequestRecord, now: float, *, forgive: bool = False) -> None:
        """Take a dispatched request off its engine (it ended, or it will be re-queued).

        `forgive`: the attempt was lost to a fault not of the request's doing; its charge is given back."""
        engine = r.engine
        assert engine is not None
        del engine.requests[r.request_id]
        slots = engine.slots
        slots.release(r.uncached_tokens, is_in_prefill=r.is_in_prefill)
        if slots.is_resting and not slots.decoding:  # nobody left to rest for
            slots.end_rest()
            self._timers.discard((TimerKind.REST, engine.engine_id))
        if r.is_large_prefill:
            engine.meter.remove_large_prefill(now)
            engine.liveness.large_prefill_tokens -= r.uncached_tokens
            r.is_large_prefill = False
        r.is_in_prefill = False
        engine.endured_prefills -= r.prefills_endured
        r.prefills_endured = 0
        engine.liveness.remove_request(r.limits.stall_timeout_s)
        engine.timers[r.clock.charge_class].discard(r.request_id)
        r.clock.end_stint(now, forgive=forgive)
        r.engine = None
        self._touch(engine)

    def _arm_request(self, r: RequestRecord, engine: EngineRecord) -> None:
        """(Re)set the request's next virtual deadline: its charged timeout or its stall check."""
        clock = r.clock
        allowance = self._own_prefill_allowance(r)
        engine.timers[clock.charge_class].set(r.request_id, min(clock.timeout_v(), clock.stall_v(allowance)))

    def _own_prefill_allowance(self, r: RequestRecord) -> float:
        if not r.is_in_prefill:
            return 0.0
        config = self._config
        return prefill_allowance_s(
            r.uncached_tokens,
            floor_tokens_per_s=config.prefill_floor_tokens_per_s,
            max_allowance_s=config.max_prefill_allowance_s,
        )

    def _touch(self, engine: EngineRecord) -> None:
        """The engine's meter, timers or liveness changed: recompute its deadlines before the call returns."""
        if self._is_engine_mode:
            self._dirty[engine.engine_id] = engine

    def _flush_deadlines(self, now: float) -> None:
        """Recompute the deadlines of every touched engine (once per engine, however often it was touched)."""
        dirty = self._dirty
        while dirty:
            _, engine = dirty.popitem()
            if engine.engine_id in self._engines:
                self._reschedule_engine(engine, now)

    def _reschedule_engine(self, engine: EngineRecord, now: float) -> None:
        """Recompute the engine's real-time charge and liveness deadlines (engine mode only)."""
        meter, (free_timers, solo_timers) = engine.meter, engine.timers
        charge_at = min(
            meter.real_at(ChargeClass.FREE, free_timers.next_at(), now),
            meter.real_at(ChargeClass.SOLO, solo_timers.next_at(), now),
        )
        self._timers.set((TimerKind.CHARGE, engine.engine_id), charge_at)
        self._timers.set((TimerKind.LIVE, engine.engine_id), self._liveness_step_at(engine))

    def _is_watched(self, engine: EngineRecord) -> bool:
        """Whether its liveness is judged: it has work, and neither it nor the gate is paused (in place)."""
        return bool(engine.requests) and not engine.is_paused and not self._gate.is_liveness_suspended

    def _hung_at(self, engine: EngineRecord) -> float:
        """When the engine counts as hung if no progress comes (math.inf while it is not watched)."""
        if not self._is_watched(engine):
            return math.inf
        return engine.liveness.judged_at(self._silence_due_at(engine), self._config.hang_check_s)

    def _liveness_step_at(self, engine: EngineRecord) -> float:
        """When its liveness next acts if no progress comes: its pause check, then its verdict (liveness.py);
        math.inf while it is not watched."""
        if not self._is_watched(engine):
            return math.inf
        return engine.liveness.next_step_at(self._silence_due_at(engine), self._config.hang_check_s)

    def _silence_due_at(self, engine: EngineRecord) -> float:
        """When the engine's silence is due for its pause check (liveness.py `due_at`, with the pool's
        prefill and warm-up allowances)."""
        config = self._config
        return engine.liveness.due_at(
            floor_tokens_per_s=config.prefill_floor_tokens_per_s,
            max_allowance_s=config.max_prefill_allowance_s,
            warmup_s=config.warmup_timeout_s,
        )

    def _drop_queue_timer(self, request_id: str) -> None:
        queue_timers = self._queue_timers
        queue_timers.discard(request_id)
        if not queue_timers:
            self._timers.discard((TimerKind.QUEUE, ""))

    def _reschedule_queue(self, now: float) -> None:
        at = self._pool.real_at(ChargeClass.FREE, self._queue_timers.next_at(), now)
        self._timers.set((TimerKind.QUEUE, ""), at)

    def _fail_pinned_waiters(self, engine_id: str, now: float, out: list[Command], detail: str) -> None:
        """Requests waiting for one engine that will not take work again soon (it left or hung) fail."""
        for rid in self._queue.ids_in_lane((engine_id, True)):
            self._fail(self._requests[rid], FailReason.NO_ENGINE, now, out, detail=detail)

    def _fire_no_engine(self, now: float, out: list[Command]) -> None:
        """No engine has been healthy for the grace period: everything waiting fails (an engine turning
        healthy cancels the timer, see `_refresh_engines`)."""
        for rid in self._queue.ids_in_order():
            r = self._requests[rid]
            self._fail(r, FailReason.NO_ENGINE, now, out, retry_after_s=self._config.no_engine_retry_after_s)

    def _start_no_engine_grace(self, now: float) -> None:
        self._no_healthy_since_at = now
        self._timers.set((TimerKind.NO_ENGINE, ""), now + self._config.no_engine_grace_s)

    def _is_failing_fast(self, now: float) -> bool:
        since = self._no_healthy_since_at
        return self._healthy == 0 and since is not None and now >= since + self._config.no_engine_grace_s

    def _abort(self, r: RequestRecord, reason: AbortReason, out: list[Command]) -> None:
        assert r.engine is not None
        out.append(Abort(request_id=r.request_id, engine_id=r.engine.engine_id, reason=reason))
        self._aborts[reason.value] = self._aborts.get(reason.value, 0) + 1

    def _fail(
        self,
        r: RequestRecord,
        reason: FailReason,
        now: float,
        out: list[Command],
        *,
        abort: AbortReason | None = None,
        retry_after_s: float = math.inf,
        detail: str = "",
    ) -> None:
        """End a live request with an error (aborting it on its engine first if `abort` is given)."""
        engine_id = r.engine.engine_id if r.engine is not None else None
        if r.engine is not None:
            if abort is not None:
                self._abort(r, abort, out)
            self._detach(r, now)
        self._queue.remove(r.request_id)
        r.move_to(RequestState.TIMED_OUT if reason in _TIMED_OUT else RequestState.FAILED)
        self._answer_failed(r, reason, now, out, retry_after_s, detail, engine_id)
        failed = GroupOutcome.ABORTED if reason is FailReason.ABORTED else GroupOutcome.FAILED
        self._leave_group(r, failed, now, out)
        self._free(r)

    def _reject(
        self,
        r: RequestRecord,
        reason: FailReason,
        now: float,
        out: list[Command],
        retry_after_s: float,
        detail: str,
    ) -> None:
        """Fail a request at arrival (never queued)."""
        r.move_to(RequestState.FAILED)
        self._answer_failed(r, reason, now, out, retry_after_s, detail)

    def _answer_failed(
        self,
        r: RequestRecord,
        reason: FailReason,
        now: float,
        out: list[Command],
        retry_after_s: float,
        detail: str,
        engine_id: str | None = None,
    ) -> None:
        """Stop the request's clocks and tell the edge how it failed, with its final timing."""
        r.clock.finish(now)
        timing = self._breakdown(r, now, engine_id)
        out.append(
            Fail(
                request_id=r.request_id,
                reason=reason,
                timing=timing,
                retry_after_s=retry_after_s,
                detail=detail,
            )
        )
        self._fails[reason.value] = self._fails.get(reason.value, 0) + 1

    def _forget(self, r: RequestRecord, now: float, out: list[Command]) -> None:
        """The client left and no retry attached: stop its generation and drop it without an answer."""
        if r.engine is not None:
            self._abort(r, AbortReason.CLIENT_GONE, out)
            self._detach(r, now)
        self._queue.remove(r.request_id)
        r.move_to(RequestState.CANCELLED)
        self._counts["client_gone"] += 1
        self._leave_group(r, GroupOutcome.ABORTED, now, out)
        self._free(r)

    def _leave_group(self, r: RequestRecord, outcome: GroupOutcome, now: float, out: list[Command]) -> None:
        """An ending request leaves its group; the group's record if it was the last (group_table.py)."""
        if r.group is not None:
            record = self._groups.leave(r.group, r.request_id, outcome, now)
            if record is not None:
                out.append(record)

    def _free(self, r: RequestRecord) -> None:
        rid = r.request_id
        del self._requests[rid]
        self._drop_queue_timer(rid)
        timers = self._timers
        for kind in (TimerKind.WALL, TimerKind.WALLCLOCK, TimerKind.GRACE):
            timers.discard((kind, rid))

    def _breakdown(self, r: RequestRecord, now: float, engine_id: str | None = None) -> TimingBreakdown:
        if engine_id is None and r.engine is not None:
            engine_id = r.engine.engine_id
        return r.clock.breakdown(now, attempts=r.attempt, engine_id=engine_id, tokens=r.tokens)

    def _mark(
        self, engine: EngineRecord, state: EngineState, now: float, out: list[Command], detail: str
    ) -> None:
        engine.state = transition(engine.state, state)
        if state is EngineState.HEALTHY:
            engine.liveness.note_resumed(now)
        elif state is EngineState.UNHEALTHY:  # it may be restarting: its next first work may compile again
            engine.liveness.note_cold(now)
        out.append(MarkEngine(engine_id=engine.engine_id, state=state.value, detail=detail))
        self._refresh_engines(now)

    def _refresh_engines(self, now: float) -> None:
        """Recompute the schedulable list and the no-engine grace after any engine change. O(E)."""
        self._schedulable = [e for e in self._engines.values() if e.is_schedulable]
        healthy = sum(1 for e in self._engines.values() if e.state is EngineState.HEALTHY)
        if healthy and not self._healthy:
            self._no_healthy_since_at = None
            self._timers.discard((TimerKind.NO_ENGINE, ""))
        elif not healthy and (self._healthy or self._no_healthy_since_at is None):
            self._start_no_engine_grace(now)
        self._healthy = healthy
