"""The gateway's state and the bookkeeping every event handler and verdict shares.

Theory of operation: `Ledger` holds everything the core knows (request and engine records, the wait queue,
meters, timers, the gate, the session table, counters) and the operations that keep it consistent: dispatching,
taking a request off its engine, re-queueing and retrying, ending a request (fail, reject, forget; completion is
in on_requests.py), marking engines, and noting which engines' real-time deadlines must be recomputed (`touch`;
verdicts.py recomputes them). `Gateway` (gateway.py) holds one and feeds each event to a handler module
(on_requests.py, on_engines.py, on_gate.py) and each due timer to verdicts.py; each of those is a plain function
of the ledger. There is one state, here, and every change to it goes through these operations or the handlers.

Requests wait in a `WaitQueue` (lanes, O(log n)); the `Dispatcher` chooses what starts where (placement policy +
admission); every request's clocks and budgets live in its `RequestClock` over per-engine `ChargeMeter`s
(request_clock.py, the one home of budget arithmetic); engines are judged by `EngineLiveness`. All timers are one
real-time `TimerHeap` of keys: per engine (charged-time verdicts, liveness, rest), per request (wall cap,
wallclock timeout, client grace), the queue-timeout heap and the no-engine timer. Charged-time verdicts of an
engine's requests are kept in that engine's virtual-time heaps, so a change of the engine's mode (a prefill
starting or ending, a pause) reschedules one key, not every request.

Rules:
1. Every path that ends a request goes through `fail`, `reject`, `forget` or the completion in on_requests.py,
   and every one of them calls `free` (records, queue entries and timers are released together).
2. `detach` is the only way a request leaves an engine; it undoes exactly what `dispatch` did.
3. Real-time timer keys are `(TimerKind, id)`: per engine CHARGE, LIVE and REST, per request WALL, WALLCLOCK
   and GRACE, one QUEUE and one NO_ENGINE key.
4. Whatever changes an engine's meter, virtual timers or liveness calls `touch(engine)`: its real-time
   deadlines are recomputed before the gateway's call returns (or at the edge's `flush_deadlines`).
"""

from __future__ import annotations

import enum
import math

from rolloutgate.core.charge_meter import ChargeClass, ChargeMeter
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
from rolloutgate.core.pace import StalenessPace
from rolloutgate.core.placement import make_policy
from rolloutgate.core.records import FRONT_TIER, NO_ENGINES, EngineRecord, RequestRecord
from rolloutgate.core.request_state import RequestState
from rolloutgate.core.session_cap import SessionCap
from rolloutgate.core.session_table import SessionTable
from rolloutgate.core.timer_heap import TimerHeap
from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.core.wait_queue import WaitQueue
from rolloutgate.core.weights import WeightVersions

__all__ = ("CHARGE_CLASSES", "Ledger", "TimerKind")


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


class Ledger:
    """State and bookkeeping of the gateway core (see the module docstring)."""

    def __init__(self, config: GatewayCoreConfig) -> None:
        self.config = config
        self.is_engine_mode = config.clock_mode is ClockMode.ENGINE
        self.requests: dict[str, RequestRecord] = {}
        self.engines: dict[str, EngineRecord] = {}
        self.schedulable: list[EngineRecord] = []
        self.healthy = 0
        self.queue = WaitQueue()
        self.pool = ChargeMeter()  # the queue's meter: FREE while the gate is open
        self.queue_timers: TimerHeap[str] = TimerHeap()  # queue deadlines in pool-meter time
        self.timers: TimerHeap[_TimerKey] = TimerHeap()  # real time
        self.gate = Gate()
        self.weights = WeightVersions(config.max_staleness)
        self.sessions = SessionTable(config.max_sessions, config.session_idle_s)
        self.session_cap = SessionCap(config.session_max_in_flight)
        self.pace = StalenessPace(config.pace_batch, config.max_staleness)  # on_stale "pace" (pace.py)
        self.has_released = False  # a held call entered the queue: the edge of the event pumps (gateway.py)
        self.groups = GroupTable()  # live groups (group_table.py); placed through the session table
        placement = config.placement if self.is_engine_mode else "least_outstanding"
        self.dispatcher = Dispatcher(
            queue=self.queue,
            policy=make_policy(
                placement, max_excess=config.affinity_max_excess, cache_tokens=config.engine_cache_tokens
            ),
            sessions=self.sessions,
            is_affine=placement != "least_outstanding",  # the others wait for a session's engine
            max_excess=config.affinity_max_excess,
        )
        self.seq = 0
        self.engine_seq = 0
        self.no_healthy_since_at: float | None = None
        self.counts: dict[str, int] = dict.fromkeys(
            ("arrived", "dispatched", "redispatched", "completed", "client_gone", "quarantined"), 0
        )
        self.fails: dict[str, int] = {}
        self.aborts: dict[str, int] = {}
        self.dirty: dict[str, EngineRecord] = {}  # engines whose real-time deadlines need recomputing

    def pump(self, now: float, out: list[Command]) -> None:
        """Dispatch whatever can start now (nothing while the gate is closed).

        While failing fast for lack of any healthy engine, whatever is (re-)queued fails instead.
        """
        self.has_released = False
        if not self.queue:
            return
        if self.healthy == 0 and self.is_failing_fast(now):
            self.fire_no_engine(now, out)
            return
        if self.gate.is_closed or not self.schedulable:
            return
        self.sessions.expire(now)
        for r, engine in self.dispatcher.decisions(self.requests, self.engines, self.schedulable):
            self.dispatch(r, engine, now, out)

    def dispatch(self, r: RequestRecord, engine: EngineRecord, now: float, out: list[Command]) -> None:
        rid = r.request_id
        self.drop_queue_timer(rid)
        uncached = self.sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id, r.group)
        if r.group is not None:  # what its siblings' prefill there saves it, beyond its own session's
            alone = self.sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id)
            self.groups.note_saved(r.group, alone - uncached)
        is_large = uncached >= self.config.contention_min_prefill_tokens
        r.uncached_tokens, r.is_in_prefill, r.is_large_prefill = uncached, True, is_large
        r.prefill_due_at = now + uncached / self.config.prefill_floor_tokens_per_s
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
        r.started_version, r.is_stale_answering = self.weights.version, False
        r.avoid_engines = NO_ENGINES
        self.sessions.record(r.routing_key, engine.engine_id, r.prompt_tokens, r.group, now=now)
        self.sessions.started(r.routing_key)
        if self.is_engine_mode:
            self.arm_request(r, engine)
            self.touch(engine)
        self.counts["dispatched"] += 1
        if r.attempt > 1:
            self.counts["redispatched"] += 1
        out.append(
            Dispatch(
                request_id=rid,
                engine_id=engine.engine_id,
                attempt=r.attempt,
                delivered_tokens=r.delivered_tokens,
            )
        )

    def enqueue(self, r: RequestRecord, now: float) -> None:
        r.move_to(RequestState.QUEUED)
        r.clock.start_queued(self.pool, now)
        if not self.is_held(r.request_id):
            self.queue.push(r.request_id, r.sort_key)
        if r.limits.queue_timeout_s != math.inf:
            self.queue_timers.set(r.request_id, r.clock.queue_v(r.limits.queue_timeout_s))
            self.reschedule_queue(now)

    def is_held(self, request_id: str) -> bool:
        """A held call waits outside the queue: over its session's cap (session_cap.py), or new work past the
        pace's budget (pace.py)."""
        return self.session_cap.is_held(request_id) or self.pace.is_held(request_id)

    @property
    def held(self) -> int:
        return self.session_cap.held + self.pace.held

    def requeue(self, r: RequestRecord, now: float, *, afresh: bool = False) -> None:
        """Put a request that was running back at the front of the queue (it keeps its original order). Its
        output is kept where its client has seen it, or where the edge can continue it and the new attempt
        is not `afresh` (meant for new weights: a stale generation, a pause that aborts for an update)."""
        r.tier = FRONT_TIER
        r.delivered_tokens = r.tokens if r.streaming or (r.continuable and not afresh) else 0
        r.tokens = r.delivered_tokens
        self.enqueue(r, now)

    def retry(self, r: RequestRecord, engine: EngineRecord, now: float) -> None:
        r.fault_attempts += 1
        r.avoid_engines = frozenset({engine.engine_id})
        self.requeue(r, now)

    def detach(self, r: RequestRecord, now: float, *, forgive: bool = False) -> None:
        """Take a dispatched request off its engine (it ended, or it will be re-queued).

        `forgive`: the attempt was lost to a fault not of the request's doing; its charge is given back."""
        engine = r.engine
        assert engine is not None
        del engine.requests[r.request_id]
        slots = engine.slots
        slots.release(r.uncached_tokens, is_in_prefill=r.is_in_prefill)
        if slots.is_resting and not slots.decoding:  # nobody left to rest for
            slots.end_rest()
            self.timers.discard((TimerKind.REST, engine.engine_id))
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
        self.sessions.ended(r.routing_key, now)
        self.touch(engine)

    def arm_request(self, r: RequestRecord, engine: EngineRecord) -> None:
        """(Re)set the request's next virtual deadline: its charged timeout or its stall check."""
        clock = r.clock
        allowance = self.own_prefill_allowance(r)
        engine.timers[clock.charge_class].set(r.request_id, min(clock.timeout_v(), clock.stall_v(allowance)))

    def own_prefill_allowance(self, r: RequestRecord) -> float:
        if not r.is_in_prefill:
            return 0.0
        config = self.config
        return prefill_allowance_s(
            r.uncached_tokens,
            floor_tokens_per_s=config.prefill_floor_tokens_per_s,
            max_allowance_s=config.max_prefill_allowance_s,
        )

    def touch(self, engine: EngineRecord) -> None:
        """The engine's meter, timers or liveness changed: recompute its deadlines before the call returns."""
        if self.is_engine_mode:
            self.dirty[engine.engine_id] = engine

    def drop_queue_timer(self, request_id: str) -> None:
        queue_timers = self.queue_timers
        queue_timers.discard(request_id)
        if not queue_timers:
            self.timers.discard((TimerKind.QUEUE, ""))

    def reschedule_queue(self, now: float) -> None:
        at = self.pool.real_at(ChargeClass.FREE, self.queue_timers.next_at(), now)
        self.timers.set((TimerKind.QUEUE, ""), at)

    def fail_pinned_waiters(self, engine_id: str, now: float, out: list[Command], detail: str) -> None:
        """Requests waiting for one engine that will not take work again soon (it left or hung) fail."""
        for rid in self.queue.ids_in_lane((engine_id, True)):
            self.fail(self.requests[rid], FailReason.NO_ENGINE, now, out, detail=detail)

    def fire_no_engine(self, now: float, out: list[Command]) -> None:
        """No engine has been healthy for the grace period: everything waiting fails (an engine turning
        healthy cancels the timer, see `refresh_engines`)."""
        for rid in self.queue.ids_in_order():
            r = self.requests[rid]
            self.fail(r, FailReason.NO_ENGINE, now, out, retry_after_s=self.config.no_engine_retry_after_s)

    def start_no_engine_grace(self, now: float) -> None:
        self.no_healthy_since_at = now
        self.timers.set((TimerKind.NO_ENGINE, ""), now + self.config.no_engine_grace_s)

    def is_failing_fast(self, now: float) -> bool:
        since = self.no_healthy_since_at
        return self.healthy == 0 and since is not None and now >= since + self.config.no_engine_grace_s

    def abort(self, r: RequestRecord, reason: AbortReason, out: list[Command]) -> None:
        assert r.engine is not None
        out.append(Abort(request_id=r.request_id, engine_id=r.engine.engine_id, reason=reason))
        self.aborts[reason.value] = self.aborts.get(reason.value, 0) + 1

    def fail(
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
                self.abort(r, abort, out)
            self.detach(r, now)
        self.queue.remove(r.request_id)
        r.move_to(RequestState.TIMED_OUT if reason in _TIMED_OUT else RequestState.FAILED)
        self.answer_failed(r, reason, now, out, retry_after_s, detail, engine_id)
        failed = GroupOutcome.ABORTED if reason is FailReason.ABORTED else GroupOutcome.FAILED
        self.leave_group(r, failed, now, out)
        self.free(r)

    def reject(
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
        self.answer_failed(r, reason, now, out, retry_after_s, detail)

    def answer_failed(
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
        timing = self.breakdown(r, now, engine_id)
        out.append(
            Fail(
                request_id=r.request_id,
                reason=reason,
                timing=timing,
                retry_after_s=retry_after_s,
                detail=detail,
            )
        )
        self.fails[reason.value] = self.fails.get(reason.value, 0) + 1

    def forget(self, r: RequestRecord, now: float, out: list[Command]) -> None:
        """The client left and no retry attached: stop its generation and drop it without an answer."""
        if r.engine is not None:
            self.abort(r, AbortReason.CLIENT_GONE, out)
            self.detach(r, now)
        self.queue.remove(r.request_id)
        r.move_to(RequestState.CANCELLED)
        self.counts["client_gone"] += 1
        self.leave_group(r, GroupOutcome.ABORTED, now, out)
        self.free(r)

    def leave_group(self, r: RequestRecord, outcome: GroupOutcome, now: float, out: list[Command]) -> None:
        """An ending request leaves its group; the group's record if it was the last (group_table.py)."""
        if r.group is not None:
            record = self.groups.leave(r.group, r.request_id, outcome, now)
            if record is not None:
                out.append(record)

    def free(self, r: RequestRecord) -> None:
        rid = r.request_id
        del self.requests[rid]
        if (successor := self.session_cap.leave(r.routing_key, rid)) is not None:  # held: takes its place
            self.queue.push(successor, self.requests[successor].sort_key)
            self.has_released = True
        self.pace.leave(rid)
        self.drop_queue_timer(rid)
        timers = self.timers
        for kind in (TimerKind.WALL, TimerKind.WALLCLOCK, TimerKind.GRACE):
            timers.discard((kind, rid))

    def breakdown(self, r: RequestRecord, now: float, engine_id: str | None = None) -> TimingBreakdown:
        if engine_id is None and r.engine is not None:
            engine_id = r.engine.engine_id
        return r.clock.breakdown(now, attempts=r.attempt, engine_id=engine_id, tokens=r.tokens)

    def mark(
        self, engine: EngineRecord, state: EngineState, now: float, out: list[Command], detail: str
    ) -> None:
        engine.state = transition(engine.state, state)
        if state is EngineState.HEALTHY:
            engine.liveness.note_resumed(now)
        elif state is EngineState.UNHEALTHY:  # it may be restarting: its next first work may compile again
            engine.liveness.note_cold(now)
        out.append(MarkEngine(engine_id=engine.engine_id, state=state.value, detail=detail))
        self.refresh_engines(now)

    def refresh_engines(self, now: float) -> None:
        """Recompute the schedulable list and the no-engine grace after any engine change. O(E)."""
        self.schedulable = [e for e in self.engines.values() if e.is_schedulable]
        healthy = sum(1 for e in self.engines.values() if e.state is EngineState.HEALTHY)
        if healthy and not self.healthy:
            self.no_healthy_since_at = None
            self.timers.discard((TimerKind.NO_ENGINE, ""))
        elif not healthy and (self.healthy or self.no_healthy_since_at is None):
            self.start_no_engine_grace(now)
        self.healthy = healthy
