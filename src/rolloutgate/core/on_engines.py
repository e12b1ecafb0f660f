"""What the gateway does when something happens to an engine: the engine events' handlers.

Theory of operation: each handler is a plain function `(ledger, event, now) -> [Command]` over the gateway's
`Ledger` (ledger.py); `Gateway` (gateway.py) calls it from its event table. An engine's state (healthy,
unhealthy, quarantined: engine_state.py) changes only through `Ledger.mark`, which also recomputes the
schedulable engines and the no-engine grace; draining and paused are flags beside it. Whatever makes room or
takes an engine back pumps the queue.

Verdicts (ENGINE clock mode; DESIGN.md is authoritative; the timers' are in verdicts.py):
- engine left (EngineLeft)            -> Abort(ENGINE_LEFT) + re-queue at the front (its charge forgiven) each
  running request; those pinned to it, running or waiting, Fail(NO_ENGINE); what waited for it as a session's
  engine goes to the shared queue
- engine draining (EngineDraining)    -> no new work; pinned waiters Fail(NO_ENGINE), affine waiters go to the
  shared queue, its running calls go on to their end
- weights behind (EngineVersionLag)   -> nothing starts there whose version policy forbids its weights
  (dispatcher.py asks `RequestRecord.allows_weights_of`); its running calls are the staleness bound's
- health check                        -> MarkEngine(healthy | unhealthy) when it changes the state (an
  EngineJoined of a known engine is a re-probe: new limits, and its health as a check)
- engine paused (EnginePaused)        -> its requests are not charged and its liveness is not judged until
  EngineResumed; unannounced (it paused itself after its last progress): its silence since its last progress
  (or since its last token, `last_output_at`) is counted as paused, not charged
- cache flushed (EngineCacheFlushed)  -> only the placement's estimate of what it caches is forgotten
"""

from __future__ import annotations

import math

from rolloutgate.core.commands import AbortReason, Command, FailReason
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.events import (
    EngineCacheFlushed,
    EngineDraining,
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    EnginePaused,
    EngineResumed,
    EngineVersionLag,
)
from rolloutgate.core.ledger import Ledger, TimerKind
from rolloutgate.core.records import EngineRecord
from rolloutgate.core.wait_queue import SHARED

__all__ = (
    "on_cache_flushed",
    "on_engine_draining",
    "on_engine_joined",
    "on_engine_left",
    "on_engine_paused",
    "on_engine_resumed",
    "on_engine_version_lag",
    "on_health_checked",
)


def on_engine_joined(ledger: Ledger, ev: EngineJoined, now: float) -> list[Command]:
    capacity = ev.capacity if ledger.is_engine_mode else math.inf
    budget = ev.prefill_token_budget if ledger.is_engine_mode else math.inf
    out: list[Command] = []
    engine = ledger.engines.get(ev.engine_id)
    if engine is None:
        ledger.engine_seq += 1
        engine = EngineRecord(
            engine_id=ev.engine_id,
            order=ledger.engine_seq,
            now=now,
            capacity=capacity,
            prefill_token_budget=budget,
            is_healthy=ev.healthy,
            is_gate_closed=ledger.gate.is_closed,
            pool_stall_timeout_s=ledger.config.engine_stall_timeout_s,
            budget_exempt_tokens=ledger.config.prefill_budget_exempt_tokens,
            rest_ratio=ledger.config.prefill_rest_ratio,
            queue=ledger.queue,
            sessions=ledger.sessions,
        )
        ledger.engines[ev.engine_id] = engine
    else:  # a re-probe: new limits, and its health as a health check
        engine.slots.capacity = capacity
        engine.slots.prefill_token_budget = budget
        _apply_health(ledger, engine, ev.healthy, now, out)
    ledger.refresh_engines(now)
    ledger.pump(now, out)
    return out


def on_engine_left(ledger: Ledger, ev: EngineLeft, now: float) -> list[Command]:
    engine = ledger.engines.get(ev.engine_id)
    if engine is None:
        return []
    out: list[Command] = []
    for r in sorted(engine.requests.values(), key=lambda r: r.sort_key):
        ledger.abort(r, AbortReason.ENGINE_LEFT, out)
        ledger.detach(r, now, forgive=True)
        if r.pinned_engine == engine.engine_id:
            ledger.fail(r, FailReason.NO_ENGINE, now, out, detail="its engine left the pool")
        else:
            ledger.requeue(r, now)
    ledger.fail_pinned_waiters(engine.engine_id, now, out, "its engine left the pool")
    for rid in ledger.queue.ids_in_lane((engine.engine_id, False)):
        ledger.queue.move(rid, SHARED)
    del ledger.engines[ev.engine_id]
    ledger.timers.discard((TimerKind.CHARGE, engine.engine_id))
    ledger.timers.discard((TimerKind.LIVE, engine.engine_id))
    ledger.timers.discard((TimerKind.REST, engine.engine_id))
    ledger.refresh_engines(now)
    ledger.pump(now, out)
    return out


def on_engine_draining(ledger: Ledger, ev: EngineDraining, now: float) -> list[Command]:
    engine = ledger.engines.get(ev.engine_id)
    if engine is None or engine.is_draining == ev.draining:
        return []
    out: list[Command] = []
    engine.is_draining = ev.draining
    if ev.draining:  # what waits for it goes to the shared queue; its running calls stay
        _send_waiters_elsewhere(ledger, engine, now, out, "its engine is being handed over")
    ledger.refresh_engines(now)
    ledger.pump(now, out)
    return out


def on_engine_version_lag(ledger: Ledger, ev: EngineVersionLag, now: float) -> list[Command]:
    """Nothing moves but what may start there: the dispatcher asks each request's policy (dispatcher.py)."""
    engine = ledger.engines.get(ev.engine_id)
    if engine is None or engine.version_lag == ev.lag:
        return []
    out: list[Command] = []
    engine.version_lag = ev.lag
    ledger.pump(now, out)
    return out


def _send_waiters_elsewhere(
    ledger: Ledger, engine: EngineRecord, now: float, out: list[Command], why: str
) -> None:
    """What waits for this engine: pinned waiters fail, affine ones go to the shared queue."""
    ledger.fail_pinned_waiters(engine.engine_id, now, out, why)
    for rid in ledger.queue.ids_in_lane((engine.engine_id, False)):
        ledger.queue.move(rid, SHARED)


def on_health_checked(ledger: Ledger, ev: EngineHealthChecked, now: float) -> list[Command]:
    engine = ledger.engines.get(ev.engine_id)
    out: list[Command] = []
    if engine is not None:
        _apply_health(ledger, engine, ev.healthy, now, out)
        ledger.refresh_engines(now)
        ledger.pump(now, out)
    return out


def _apply_health(
    ledger: Ledger, engine: EngineRecord, healthy: bool, now: float, out: list[Command]
) -> None:
    if healthy and engine.state is not EngineState.HEALTHY:
        ledger.mark(engine, EngineState.HEALTHY, now, out, "health check passed")
    elif not healthy and engine.state is EngineState.HEALTHY:
        ledger.mark(engine, EngineState.UNHEALTHY, now, out, "health check failed")


def on_engine_paused(ledger: Ledger, ev: EnginePaused, now: float) -> list[Command]:
    engine = ledger.engines.get(ev.engine_id)
    if engine is not None and not engine.is_paused:
        engine.is_paused = True
        if ev.unannounced:  # it paused itself after its last progress: its silence is the pause's
            since = engine.liveness.silent_since_at(ev.last_output_at)
            since = engine.meter.backdate_pause(since, now)
            for r in engine.requests.values():
                r.clock.rebase(since, now)
        else:
            engine.meter.set_paused(now, True)
        ledger.touch(engine)
        ledger.refresh_engines(now)
    return []


def on_cache_flushed(ledger: Ledger, ev: EngineCacheFlushed, now: float) -> list[Command]:
    # Only the placement's estimate changes; nothing in flight or queued moves because of it.
    ledger.sessions.forget_cached(ev.engine_id)
    return []


def on_engine_resumed(ledger: Ledger, ev: EngineResumed, now: float) -> list[Command]:
    engine = ledger.engines.get(ev.engine_id)
    out: list[Command] = []
    if engine is not None and engine.is_paused:
        engine.is_paused = False
        engine.meter.set_paused(now, ledger.gate.is_closed)
        engine.liveness.note_resumed(now)
        ledger.touch(engine)
        ledger.refresh_engines(now)
        ledger.pump(now, out)
    return out
