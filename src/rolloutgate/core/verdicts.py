"""The verdicts: what the gateway decides when a deadline passes, and when each deadline is.

Theory of operation: every real-time timer is a key `(TimerKind, id)` in the ledger's one `TimerHeap`
(ledger.py). `Gateway.on_time(now)` pops each due key and hands it to `fire`, which applies its verdict. A
request's charged-time verdicts are kept in its engine's virtual-time heaps (one per charge class); the engine's
CHARGE key is when the earliest of them comes in real time at the engine's current rates, and its LIVE key when
its liveness next acts. Whatever changes an engine's meter, heaps or liveness marks it touched
(`Ledger.touch`); `flush_deadlines` recomputes both keys of every touched engine once, before the gateway's call
returns. A key that fires early (a rate changed since it was set) finds nothing due and is set again.

Verdicts (ENGINE clock mode; DESIGN.md is authoritative):
- charged > timeout_s                 -> Abort(TIMEOUT) + Fail(TIMEOUT) with the timing breakdown
- queue > queue_timeout_s             -> Fail(QUEUE_TIMEOUT, retry_after)
- wall > max_wall_s                   -> Abort(MAX_WALL) if dispatched + Fail(MAX_WALL)
- engine silent for its stall window (at least warmup_timeout_s before its first progress since it joined
  or was last marked unhealthy: a compile is not a hang, liveness.py "Warm-up"; a pause it reported,
  EnginePaused, is not silence: on_engines.py)
                                      -> CheckEngine (is it paused?) hang_check_s before the window ends,
  then, still silent at its end, MarkEngine(quarantined), Abort(ENGINE_HUNG) + re-queue at the front avoiding
  it, or Fail(ATTEMPTS_EXHAUSTED) past max_attempts (requests pinned to that engine fail with NO_ENGINE, as when
  their engine leaves; while their engine is merely unhealthy or paused they wait)
- request stuck alone (no progress for its stall_timeout of charged time while its engine progressed on
  others, within the last stall_recheck_s) -> Abort(STUCK) + re-queue once avoiding that engine; stuck
  again -> Fail(STALL)
- client gone for retry_grace_s       -> Abort(CLIENT_GONE) if dispatched, forgotten (no Fail: no client)
- no healthy engine for no_engine_grace_s -> queued Fail(NO_ENGINE, retry_after), new ones fail at once
  (`Ledger.fire_no_engine`; arrivals: on_requests.py)
- an engine's rest after its budgeted prefills ends (admission.py) -> the pump may start its next prefill
In WALLCLOCK mode only the wall cap, the queue timeout, the no-engine grace and the wallclock timeout (wall time
since arrival: Fail(TIMEOUT), no Abort) apply (gateway.py).

Events bring the other verdicts: on_requests.py (upstream failures, aborted groups), on_gate.py (stale weights).
"""

from __future__ import annotations

import math

from rolloutgate.core.charge_meter import EPSILON_S, ChargeClass
from rolloutgate.core.commands import AbortReason, CheckEngine, Command, FailReason
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.ledger import CHARGE_CLASSES, Ledger, TimerKind
from rolloutgate.core.records import EngineRecord, RequestRecord

__all__ = ("fire", "flush_deadlines", "hung_at")


def fire(ledger: Ledger, kind: TimerKind, ident: str, now: float, out: list[Command]) -> None:
    """Apply the verdict of the due timer `(kind, ident)` (the ledger's rule 3 lists the keys)."""
    if kind == TimerKind.CHARGE:
        _fire_charge(ledger, ident, now, out)
    elif kind == TimerKind.LIVE:
        _fire_liveness(ledger, ident, now, out)
    elif kind == TimerKind.QUEUE:
        _fire_queue(ledger, now, out)
    elif kind == TimerKind.NO_ENGINE:
        ledger.fire_no_engine(now, out)
    elif kind == TimerKind.REST:
        ledger.engines[ident].slots.end_rest()  # the pump after the timers may start its next prefill
    else:
        r = ledger.requests[ident]
        if kind == TimerKind.WALL:
            abort = AbortReason.MAX_WALL if r.engine is not None else None
            ledger.fail(r, FailReason.MAX_WALL, now, out, abort=abort)
        elif kind == TimerKind.WALLCLOCK:
            ledger.fail(r, FailReason.TIMEOUT, now, out, detail="wall time since arrival")
        else:
            ledger.forget(r, now, out)


# --- when ------------------------------------------------------------------------------------------------


def flush_deadlines(ledger: Ledger, now: float) -> None:
    """Recompute the deadlines of every touched engine (once per engine, however often it was touched)."""
    dirty = ledger.dirty
    while dirty:
        _, engine = dirty.popitem()
        if engine.engine_id in ledger.engines:
            _reschedule_engine(ledger, engine, now)


def _reschedule_engine(ledger: Ledger, engine: EngineRecord, now: float) -> None:
    """Recompute the engine's real-time charge and liveness deadlines (engine mode only)."""
    meter, (free_timers, solo_timers) = engine.meter, engine.timers
    charge_at = min(
        meter.real_at(ChargeClass.FREE, free_timers.next_at(), now),
        meter.real_at(ChargeClass.SOLO, solo_timers.next_at(), now),
    )
    ledger.timers.set((TimerKind.CHARGE, engine.engine_id), charge_at)
    ledger.timers.set((TimerKind.LIVE, engine.engine_id), _liveness_step_at(ledger, engine))


def _is_watched(ledger: Ledger, engine: EngineRecord) -> bool:
    """Whether its liveness is judged: it has work, and neither it nor the gate is paused (in place)."""
    return bool(engine.requests) and not engine.is_paused and not ledger.gate.is_liveness_suspended


def hung_at(ledger: Ledger, engine: EngineRecord) -> float:
    """When the engine counts as hung if no progress comes (math.inf while it is not watched)."""
    if not _is_watched(ledger, engine):
        return math.inf
    return engine.liveness.judged_at(_silence_due_at(ledger, engine), ledger.config.hang_check_s)


def _liveness_step_at(ledger: Ledger, engine: EngineRecord) -> float:
    """When its liveness next acts if no progress comes: its pause check, then its verdict (liveness.py);
    math.inf while it is not watched."""
    if not _is_watched(ledger, engine):
        return math.inf
    return engine.liveness.next_step_at(_silence_due_at(ledger, engine), ledger.config.hang_check_s)


def _silence_due_at(ledger: Ledger, engine: EngineRecord) -> float:
    """When the engine's silence is due for its pause check (liveness.py `due_at`, with the pool's
    prefill and warm-up allowances)."""
    config = ledger.config
    return engine.liveness.due_at(
        floor_tokens_per_s=config.prefill_floor_tokens_per_s,
        max_allowance_s=config.max_prefill_allowance_s,
        warmup_s=config.warmup_timeout_s,
    )


# --- what ------------------------------------------------------------------------------------------------


def _fire_charge(ledger: Ledger, engine_id: str, now: float, out: list[Command]) -> None:
    """Judge every request of the engine whose virtual deadline has come (the earliest class first)."""
    engine = ledger.engines[engine_id]
    meter = engine.meter
    while True:
        due = None
        for cls in CHARGE_CLASSES:
            if meter.is_running(cls) and engine.timers[cls].next_at() <= meter.value(cls, now) + EPSILON_S:
                due = cls
                break
        if due is None:
            break
        rid = engine.timers[due].pop_due(math.inf)
        assert rid is not None
        _judge(ledger, ledger.requests[rid], engine, meter.value(due, now) + EPSILON_S, now, out)
    ledger.touch(engine)


def _judge(
    ledger: Ledger, r: RequestRecord, engine: EngineRecord, v_now: float, now: float, out: list[Command]
) -> None:
    """A request's virtual deadline came: timed out, stuck, or not yet (re-arm)."""
    clock = r.clock
    timeout_v = clock.timeout_v()
    if timeout_v <= v_now:
        ledger.fail(r, FailReason.TIMEOUT, now, out, abort=AbortReason.TIMEOUT, detail="charged engine time")
        return
    stall_v = clock.stall_v(ledger.own_prefill_allowance(r))
    if stall_v > v_now:
        engine.timers[clock.charge_class].set(r.request_id, min(timeout_v, stall_v))
    elif _progresses_without(ledger, engine, clock.progress_at, now):
        _stuck(ledger, r, engine, now, out)
    else:
        # the whole engine is silent (for stall_recheck_s at least: one that went silent just after this
        # request, paused or frozen with it, is not "progressing on others"): engine liveness decides,
        # with its pause check; look again shortly
        engine.timers[clock.charge_class].set(
            r.request_id, min(timeout_v, v_now + ledger.config.stall_recheck_s)
        )


def _progresses_without(ledger: Ledger, engine: EngineRecord, since: float, now: float) -> bool:
    """Whether the engine progressed after `since` and is still progressing (within stall_recheck_s)."""
    last = engine.liveness.last_progress_at
    return last > since and last >= now - ledger.config.stall_recheck_s


def _stuck(ledger: Ledger, r: RequestRecord, engine: EngineRecord, now: float, out: list[Command]) -> None:
    ledger.abort(r, AbortReason.STUCK, out)
    ledger.detach(r, now, forgive=True)
    if r.stuck_count or r.fault_attempts >= ledger.config.max_attempts:
        ledger.fail(r, FailReason.STALL, now, out, detail="no progress while its engine progressed")
    else:
        r.stuck_count += 1
        ledger.retry(r, engine, now)


def _fire_liveness(ledger: Ledger, engine_id: str, now: float, out: list[Command]) -> None:
    """The engine's silence is due for its pause check, or long enough to be a hang."""
    engine = ledger.engines[engine_id]
    due_at = _silence_due_at(ledger, engine)
    check_s = ledger.config.hang_check_s
    if check_s > 0 and due_at - check_s <= now and engine.liveness.ask_check(now):
        out.append(CheckEngine(engine_id=engine_id))  # someone else may have paused it: ask first
    step_at = engine.liveness.next_step_at(due_at, check_s)
    if step_at > now:
        ledger.timers.set((TimerKind.LIVE, engine_id), step_at)
        return
    silent_s = now - engine.liveness.silent_since_at()
    ledger.counts["quarantined"] += 1
    ledger.mark(engine, EngineState.QUARANTINED, now, out, f"no progress for {silent_s:.1f}s")
    for r in sorted(engine.requests.values(), key=lambda r: r.sort_key):
        ledger.abort(r, AbortReason.ENGINE_HUNG, out)
        ledger.detach(r, now, forgive=True)
        if r.pinned_engine == engine_id:
            ledger.fail(r, FailReason.NO_ENGINE, now, out, detail="its engine hung")
        elif r.fault_attempts >= ledger.config.max_attempts:
            ledger.fail(r, FailReason.ATTEMPTS_EXHAUSTED, now, out, detail="its engine hung")
        else:
            ledger.retry(r, engine, now)
    ledger.fail_pinned_waiters(engine_id, now, out, "its engine hung")


def _fire_queue(ledger: Ledger, now: float, out: list[Command]) -> None:
    """Fail every queued request past its queue timeout (counted on the queue's meter: not while gated)."""
    limit = ledger.pool.value(ChargeClass.FREE, now) + EPSILON_S
    while (rid := ledger.queue_timers.pop_due(limit)) is not None:
        r = ledger.requests[rid]
        ledger.fail(r, FailReason.QUEUE_TIMEOUT, now, out, retry_after_s=ledger.config.retry_after_s)
    ledger.reschedule_queue(now)
