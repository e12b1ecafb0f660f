"""What the gateway does when something happens to a request: the request events' handlers.

Theory of operation: each handler is a plain function `(ledger, event, now) -> [Command]` over the gateway's
`Ledger` (ledger.py); `Gateway` (gateway.py) calls it from its event table. An arrival is placed at once when
the queue is empty (`Dispatcher.place_arrival`), else queued for the pump. Progress is the hottest call (once
per upstream chunk): it is O(1) and allocation-free apart from the (empty) result list, except the first
progress of an attempt, which ends its prefill. Whatever ends or frees a request pumps the queue, so what waits
starts in the same call.

Verdicts the events bring (ENGINE clock mode; DESIGN.md is authoritative; the timers' are in verdicts.py):
- UpstreamFailed by the engine's own abort-mode pause (`engine_paused`) -> re-queued afresh, no fault counted
- retryable UpstreamFailed            -> re-queue avoiding that engine, up to max_attempts, then
  Fail(ATTEMPTS_EXHAUSTED); not retryable -> Fail(UPSTREAM); `engine_unreachable` -> MarkEngine(unhealthy);
  `engine_lost` (the engine dropped the call) while the request was in prefill, the second time
  (POISON_PREFILL_LOSSES) -> Fail(ENGINE_LOST_IN_PREFILL): a request that two engines died prefilling is not
  sent to kill a third
- client gone                         -> after retry_grace_s (a GRACE timer, verdicts.py; at once when it is 0)
  Abort(CLIENT_GONE) if dispatched, forgotten (no Fail: no client); ClientAttached in time cancels it
- queue aborted (QueueAborted)        -> Fail(ABORTED) each waiting request (or each listed); running ones run on
- its group aborted (GroupAborted)    -> Abort(GROUP_ABORTED) if dispatched + Fail(ABORTED), each live member;
  a group's last member ending        -> RecordGroup (its outcome and completion time, group_table.py)
- arrival with no healthy engine for no_engine_grace_s, pinned to an unknown engine, or at a full queue
                                      -> Fail(NO_ENGINE | QUEUE_FULL, retry_after) at once (never queued)

Rules:
1. Events for unknown requests (ended, forgotten) or for a stale attempt are ignored: the edge races the core.
2. A `RequestArrived` whose id is still live raises ValueError (the edge must use unique ids).
"""

from __future__ import annotations

import math

from rolloutgate.core.charge_meter import ChargeClass
from rolloutgate.core.commands import AbortReason, Command, Complete, FailReason, GroupOutcome
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.events import (
    ClientAttached,
    ClientDisconnected,
    GroupAborted,
    ProgressReported,
    QueueAborted,
    RequestArrived,
    SessionEnded,
    UpstreamFailed,
    UpstreamFinished,
)
from rolloutgate.core.ledger import Ledger, TimerKind
from rolloutgate.core.records import EngineRecord, RequestRecord
from rolloutgate.core.request_state import RequestState

__all__ = (
    "POISON_PREFILL_LOSSES",
    "on_arrived",
    "on_attached",
    "on_disconnected",
    "on_finished",
    "on_group_aborted",
    "on_progress",
    "on_queue_aborted",
    "on_session_ended",
    "on_upstream_failed",
)

# An engine that dies drops every call on it, and the ones it was prefilling may be what killed it (an input its
# model cannot embed, a prompt that exhausts its memory). Once is no proof: an engine restarted, killed for
# memory or lost with its node drops its prefills too, and those must move like the rest. Twice is: a request two
# engines died prefilling fails rather than go on to kill a third and every request there with it.
POISON_PREFILL_LOSSES = 2


def on_arrived(ledger: Ledger, ev: RequestArrived, now: float) -> list[Command]:
    if ev.request_id in ledger.requests:
        raise ValueError(f"request {ev.request_id!r} is already live")
    ledger.seq += 1
    ledger.counts["arrived"] += 1
    r = RequestRecord(ev, seq=ledger.seq, now=now)
    out: list[Command] = []
    if ledger.healthy == 0 and ledger.no_healthy_since_at is None:
        ledger.start_no_engine_grace(now)
    if ledger.is_failing_fast(now):
        ledger.reject(
            r, FailReason.NO_ENGINE, now, out, ledger.config.no_engine_retry_after_s, "no healthy engine"
        )
    elif ev.pinned_engine is not None and ev.pinned_engine not in ledger.engines:
        ledger.reject(
            r, FailReason.NO_ENGINE, now, out, ledger.config.no_engine_retry_after_s, "unknown engine"
        )
    elif len(ledger.queue) + ledger.held >= ledger.config.max_queue:
        ledger.reject(r, FailReason.QUEUE_FULL, now, out, ledger.config.retry_after_s, "queue full")
    else:
        ledger.requests[r.request_id] = r
        if r.group is not None:
            ledger.groups.join(r.group, r.request_id, now)
        # else held: over its session's cap (session_cap.py), or new work the trainer is not ready for (pace.py)
        is_admitted = ledger.session_cap.admit(r.routing_key, r.request_id) and ledger.pace.admit(
            r.request_id,
            opens_work=r.routing_key is None or ledger.sessions.is_new_session(r.routing_key),
            version=ledger.weights.version,
        )
        engine = _direct_engine(ledger, r, now) if is_admitted else None
        if engine is None:
            ledger.enqueue(r, now)
        else:
            r.move_to(RequestState.QUEUED)  # through the queue in no time (no queue time, no timer)
        if r.limits.max_wall_s != math.inf:
            ledger.timers.set((TimerKind.WALL, r.request_id), r.clock.wall_deadline_at(r.limits.max_wall_s))
        if not ledger.is_engine_mode:
            ledger.timers.set((TimerKind.WALLCLOCK, r.request_id), r.clock.wallclock_deadline_at())
        if engine is None:
            ledger.pump(now, out)
        else:
            ledger.dispatch(r, engine, now, out)
    return out


def _direct_engine(ledger: Ledger, r: RequestRecord, now: float) -> EngineRecord | None:
    """The engine a request arriving at an empty queue starts on at once (`Dispatcher.place_arrival`),
    else None: it is queued and the pump decides. Most arrivals find the queue empty; this skips the
    queue's bookkeeping and the general decision loop for them (the same decision, tested)."""
    if not ledger.config.direct_arrivals or ledger.queue or ledger.gate.is_closed or not ledger.schedulable:
        return None
    ledger.sessions.expire(now)  # as the pump does before its decisions: idle sessions count nowhere
    return ledger.dispatcher.place_arrival(r, ledger.schedulable)


def on_progress(ledger: Ledger, ev: ProgressReported, now: float) -> list[Command]:
    r = ledger.requests.get(ev.request_id)
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
        return _end_prefill(ledger, r, engine, now)
    r.clock.note_progress(now)
    return []


def _end_prefill(ledger: Ledger, r: RequestRecord, engine: EngineRecord, now: float) -> list[Command]:
    """First progress of an attempt: its prefill is over (budget freed, contention may end)."""
    r.move_to(RequestState.STREAMING)
    r.is_in_prefill = False
    rest_until_at = engine.slots.finish_prefill(r.uncached_tokens, now)
    if rest_until_at != math.inf:
        ledger.timers.set((TimerKind.REST, engine.engine_id), rest_until_at)
    if r.is_large_prefill:
        _note_prefill_endured(r, engine)
        r.is_large_prefill = False
        engine.meter.remove_large_prefill(now)
        engine.liveness.large_prefill_tokens -= r.uncached_tokens
        if ledger.is_engine_mode:
            engine.timers[ChargeClass.SOLO].discard(r.request_id)
        r.clock.switch_class(ChargeClass.FREE, now)
    r.clock.note_progress(now)
    if ledger.is_engine_mode:
        ledger.arm_request(r, engine)
        ledger.touch(engine)
    out: list[Command] = []
    if engine.slots.prefill_token_budget != math.inf:
        ledger.pump(now, out)  # prefill budget freed: something may fit now
    return out


def _note_prefill_endured(prefilled: RequestRecord, engine: EngineRecord) -> None:
    """Every decode on the engine sat through `prefilled`'s long prefill: placement weighs them by it.

    O(requests there), once per long prefill (rare next to progress events)."""
    endured = 0
    for q in engine.requests.values():
        if q is not prefilled and not q.is_in_prefill:
            q.prefills_endured += 1
            endured += 1
    engine.endured_prefills += endured


def on_finished(ledger: Ledger, ev: UpstreamFinished, now: float) -> list[Command]:
    r = ledger.requests.get(ev.request_id)
    if r is None or r.engine is None or (ev.attempt is not None and ev.attempt != r.attempt):
        return []
    ledger.sessions.grow(r.routing_key, r.engine.engine_id, r.prompt_tokens + r.tokens, now=now)
    engine_id = r.engine.engine_id
    ledger.detach(r, now)
    r.move_to(RequestState.DONE)
    r.clock.finish(now)
    out: list[Command] = [Complete(request_id=r.request_id, timing=ledger.breakdown(r, now, engine_id))]
    ledger.counts["completed"] += 1
    ledger.leave_group(r, GroupOutcome.FINISHED, now, out)
    ledger.free(r)
    ledger.pump(now, out)
    return out


def on_upstream_failed(ledger: Ledger, ev: UpstreamFailed, now: float) -> list[Command]:
    r = ledger.requests.get(ev.request_id)
    engine = None if r is None else r.engine
    if r is None or engine is None or (ev.attempt is not None and ev.attempt != r.attempt):
        return []
    out: list[Command] = []
    if ev.engine_unreachable and engine.state is EngineState.HEALTHY:
        ledger.mark(engine, EngineState.UNHEALTHY, now, out, ev.reason)
    if ev.engine_lost and r.is_in_prefill:
        r.prefill_losses += 1
    ledger.detach(r, now, forgive=ev.retryable)
    detail = ev.reason if ev.status is None else f"{ev.reason} (status {ev.status})"
    if not ev.retryable:
        ledger.fail(r, FailReason.UPSTREAM, now, out, detail=detail)
    elif ev.engine_paused:  # new weights may follow the pause: afresh, as the gate's own abort mode does
        ledger.requeue(r, now, afresh=True)
    elif r.prefill_losses >= POISON_PREFILL_LOSSES:
        ledger.fail(r, FailReason.ENGINE_LOST_IN_PREFILL, now, out, detail=detail)
    elif r.fault_attempts >= ledger.config.max_attempts:
        ledger.fail(r, FailReason.ATTEMPTS_EXHAUSTED, now, out, detail=detail)
    else:
        ledger.retry(r, engine, now)
    ledger.pump(now, out)
    return out


def on_disconnected(ledger: Ledger, ev: ClientDisconnected, now: float) -> list[Command]:
    r = ledger.requests.get(ev.request_id)
    if r is None or not ledger.is_engine_mode:
        return []
    r.is_disconnected = True
    out: list[Command] = []
    key = (TimerKind.GRACE, r.request_id)
    if ledger.config.retry_grace_s == 0:
        ledger.forget(r, now, out)
        ledger.pump(now, out)
    elif key not in ledger.timers:  # a repeated disconnect keeps the first deadline
        ledger.timers.set(key, now + ledger.config.retry_grace_s)
    return out


def on_attached(ledger: Ledger, ev: ClientAttached, now: float) -> list[Command]:
    r = ledger.requests.get(ev.request_id)
    if r is not None:
        r.is_disconnected = False
        ledger.timers.discard((TimerKind.GRACE, r.request_id))
    return []


def on_queue_aborted(ledger: Ledger, ev: QueueAborted, now: float) -> list[Command]:
    out: list[Command] = []
    held = sorted(
        (ledger.requests[rid] for rid in ledger.session_cap.held_ids() | ledger.pace.held_ids()),
        key=lambda r: r.sort_key,
    )  # waiting too, outside the queue
    for request_id in [*ledger.queue.ids_in_order(), *(r.request_id for r in held)]:
        if ev.request_ids is not None and request_id not in ev.request_ids:
            continue
        ledger.fail(ledger.requests[request_id], FailReason.ABORTED, now, out, detail="abort_request")
    return out


def on_group_aborted(ledger: Ledger, ev: GroupAborted, now: float) -> list[Command]:
    out: list[Command] = []
    for request_id in ledger.groups.members(ev.group):
        r = ledger.requests[request_id]
        abort = AbortReason.GROUP_ABORTED if r.engine is not None else None
        ledger.fail(r, FailReason.ABORTED, now, out, abort=abort, detail="its group was aborted")
    ledger.pump(now, out)  # their slots are free
    return out


def on_session_ended(ledger: Ledger, ev: SessionEnded, now: float) -> list[Command]:
    # Only the placement's memory changes: the session's calls still in flight or queued run on.
    ledger.sessions.release(ev.routing_key)
    return []
