"""What the gateway does when the weights change: the gate's and the weight updates' handlers.

Theory of operation: each handler is a plain function `(ledger, event, now) -> [Command]` over the gateway's
`Ledger` (ledger.py); `Gateway` (gateway.py) calls it from its event table. Closing the gate (gate.py) pauses
every meter, the queue's included, so nobody is charged and no queue time counts while it is closed, and stops
the pump; opening it resumes them, restarts every engine's stall window and dispatches what fits. A weight
update advances the gateway's weight version (weights.py) and ends the attempts that run past the staleness
bound.

Verdicts (DESIGN.md is authoritative):
- gate closed in ABORT mode           -> Abort(REQUEUE) + re-queue at the front, each running request (DRAIN,
  IN_PLACE, RETRACT and EXTERNAL leave them on their engines, uncharged: gate.py)
- running past max_staleness at a weight update -> Abort(STALE) + re-queue from scratch (its charge
  forgiven), or with on_stale "partial" Abort(STALE_PARTIAL): its engine answers it with its partial output
"""

from __future__ import annotations

from rolloutgate.core.commands import AbortReason, Command
from rolloutgate.core.events import GateClosed, GateOpened, PauseMode, WeightsUpdated
from rolloutgate.core.ledger import Ledger, TimerKind

__all__ = ("on_gate_closed", "on_gate_opened", "on_weights_updated")


def on_gate_closed(ledger: Ledger, ev: GateClosed, now: float) -> list[Command]:
    ledger.gate.close(ev.mode, now)
    ledger.pool.set_paused(now, True)
    ledger.timers.discard((TimerKind.QUEUE, ""))
    out: list[Command] = []
    in_flight = [r for e in ledger.engines.values() for r in e.requests.values()]
    for engine in ledger.engines.values():
        engine.meter.set_paused(now, True)
        ledger.touch(engine)
    if ev.mode is PauseMode.ABORT:
        for r in sorted(in_flight, key=lambda r: r.sort_key):
            ledger.abort(r, AbortReason.REQUEUE, out)
            ledger.detach(r, now)
            ledger.requeue(r, now, afresh=True)
    return out


def on_gate_opened(ledger: Ledger, ev: GateOpened, now: float) -> list[Command]:
    out: list[Command] = []
    if not ledger.gate.open():
        return out
    ledger.pool.set_paused(now, False)
    ledger.reschedule_queue(now)
    for engine in ledger.engines.values():
        engine.meter.set_paused(now, engine.is_paused)
        engine.liveness.note_resumed(now)
        ledger.touch(engine)
    ledger.pump(now, out)
    return out


def on_weights_updated(ledger: Ledger, ev: WeightsUpdated, now: float) -> list[Command]:
    """One more weight version; what runs past the staleness bound ends its attempt (weights.py)."""
    weights = ledger.weights
    out: list[Command] = []
    weights.advance(ev.engine_version)
    running = [r for e in ledger.engines.values() for r in e.requests.values()]
    for r in sorted(running, key=lambda r: r.sort_key):
        if ledger.pace.is_on or r.is_stale_answering or not weights.is_stale(r.started_version):
            continue  # under pace nothing running is aborted: the budget bounds staleness (pace.py)
        if ledger.config.on_stale == "partial":  # its engine answers it with what it generated so far
            ledger.abort(r, AbortReason.STALE_PARTIAL, out)
            r.is_stale_answering = True
            weights.stale_partial += 1
        else:
            ledger.abort(r, AbortReason.STALE, out)
            ledger.detach(r, now, forgive=True)
            ledger.requeue(r, now, afresh=True)
            weights.stale_requeued += 1
    for request_id in ledger.pace.release(weights.version):  # new work the trainer now has room for
        ledger.queue.push(request_id, ledger.requests[request_id].sort_key)
    ledger.pump(now, out)
    return out
