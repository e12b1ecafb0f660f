"""Request clocks: one request's budgets over the charge meters of its stints (charge_meter.py).

Theory of operation
-------------------
A request's life is a sequence of stints, queued (on the pool meter) or dispatched (on its engine's meter);
its charged time is the growth of its charge class's integral over its dispatched stints (charge_meter.py).
Per request (all durations in seconds):

    wall        = now - arrived_at
    queue       = FREE time of the pool meter during queued stints
    paused      = PAUSED time of either meter, queued or dispatched
    dispatched  = real time of dispatched stints
    charged     = class time during dispatched stints, less attempts lost to engine faults (forgiven)
    forgiven    = charge of attempts lost to faults not of the request's doing (engine hung or left, broken
                  connection, stuck there): the attempt that answers gets the whole budget
    contention  = dispatched - paused (while dispatched) - charged - forgiven
    stall       = real time since the last progress (or dispatch) in the current attempt

The stall *budget* is measured in the same virtual time as the charge: "no progress for stall_timeout of time
in which the request should have been progressing", so contention and pauses never count as a stall. A resume
(the meter leaving PAUSED) restarts every request's stall window on that meter.

A pause learned late (`ChargeMeter.backdate_pause`): `RequestClock.rebase(since, now)` moves the marks of a
request that began its stint after `since` (it was charged nothing, only paused, since).

Rules:
1. This module and charge_meter.py are the one home of budget arithmetic (what is charged, what is not, and
   when budgets run out): no other module adds or subtracts durations to judge a budget.
2. `deadline_at(now)` is math.inf while the request is not charging.
"""

from __future__ import annotations

import math

from rolloutgate.core.charge_meter import ChargeClass, ChargeMeter
from rolloutgate.core.timing import TimingBreakdown

__all__ = ("RequestClock",)


class RequestClock:
    """One request's clocks and budgets; see the module docstring for the definitions."""

    __slots__ = (
        "_attempt_charge0",
        "_charge0",
        "_charged_s",
        "_cls",
        "_dispatched_s",
        "_ended_at",
        "_forgiven_s",
        "_is_dispatched",
        "_meter",
        "_paused0",
        "_paused_dispatched_s",
        "_paused_queued_s",
        "_queue_s",
        "_stall_s",
        "_stint_at",
        "arrived_at",
        "progress_at",
        "progress_v",
        "stall_timeout_s",
        "timeout_s",
    )

    def __init__(self, *, arrived_at: float, timeout_s: float, stall_timeout_s: float) -> None:
        self.arrived_at = arrived_at
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s
        self._queue_s = 0.0
        self._paused_queued_s = 0.0
        self._paused_dispatched_s = 0.0
        self._dispatched_s = 0.0
        self._charged_s = 0.0
        self._forgiven_s = 0.0  # charge of attempts lost to engine faults, given back (see `end_stint`)
        self._attempt_charge0 = 0.0  # charged time when the current attempt was dispatched
        self._stall_s = 0.0
        self._meter: ChargeMeter | None = None
        self._cls = ChargeClass.FREE
        self._is_dispatched = False
        self._stint_at = arrived_at
        self._paused0 = 0.0
        self._charge0 = 0.0
        self._ended_at = math.inf
        self.progress_at = arrived_at  # real time of the last progress (or of the dispatch)
        self.progress_v = 0.0  # class integral at that moment

    # --- stints ----------------------------------------------------------------------------------------

    def start_queued(self, pool: ChargeMeter, now: float) -> None:
        """Begin a stint in the gateway's queue (the pool meter is FREE while the gate is open)."""
        self.end_stint(now)
        self._meter = pool
        self._is_dispatched = False
        self._cls = ChargeClass.FREE
        self._stint_at = now
        self._paused0 = pool.paused_value(now)
        self._charge0 = pool.value(ChargeClass.FREE, now)

    def start_dispatched(self, meter: ChargeMeter, cls: ChargeClass, now: float) -> None:
        """Begin a stint on an engine, charged in class `cls`."""
        self.end_stint(now)
        self._attempt_charge0 = self._charged_s
        self._meter = meter
        self._is_dispatched = True
        self._cls = cls
        self._stint_at = now
        self._paused0 = meter.paused_value(now)
        self._charge0 = meter.value(cls, now)
        self.progress_at = now
        self.progress_v = self._charge0

    def switch_class(self, cls: ChargeClass, now: float) -> None:
        """The request's own large prefill ended: bank the charge so far and continue in class `cls`."""
        meter = self._meter
        if meter is None or not self._is_dispatched:
            raise ValueError("switch_class needs a dispatched stint")
        self._charged_s += meter.value(self._cls, now) - self._charge0
        self._cls = cls
        self._charge0 = meter.value(cls, now)

    def note_progress(self, now: float) -> None:
        """The engine produced output for this request (hot path: O(1), no allocation)."""
        self.progress_at = now
        meter = self._meter
        if meter is not None:
            self.progress_v = meter.value(self._cls, now)

    def rebase(self, since: float, now: float) -> None:
        """Its meter was just counted PAUSED from `since` (`ChargeMeter.backdate_pause`): a stint that began
        after `since` was paused throughout, never charged (module docstring)."""
        meter = self._meter
        if meter is None or not self._is_dispatched or self._stint_at <= since:
            return
        self._charge0 = meter.value(self._cls, now)
        self._paused0 = meter.paused_value(now) - (now - self._stint_at)
        self.progress_v = min(self.progress_v, self._charge0)

    def end_stint(self, now: float, *, forgive: bool = False) -> None:
        """Bank the current stint (no-op if there is none).

        `forgive`: the attempt's work was lost to a fault that is not the request's doing (its engine hung or
        left, the connection broke, it was stuck there): its charge is moved to `forgiven`, so the attempt that
        answers has the whole budget. Faults are bounded by `max_attempts`, so this cannot repeat forever.
        """
        meter = self._meter
        if meter is None:
            return
        paused = meter.paused_value(now) - self._paused0
        charge = meter.value(self._cls, now) - self._charge0
        if self._is_dispatched:
            self._dispatched_s += now - self._stint_at
            self._paused_dispatched_s += paused
            self._charged_s += charge
            self._stall_s = now - self.progress_at
            if forgive:
                lost = self._charged_s - self._attempt_charge0
                self._charged_s -= lost
                self._forgiven_s += lost
        else:
            self._queue_s += charge
            self._paused_queued_s += paused
        self._meter = None
        self._is_dispatched = False

    def finish(self, now: float) -> None:
        """The request ended: freeze every clock at `now`."""
        self.end_stint(now)
        self._ended_at = now

    # --- readings --------------------------------------------------------------------------------------

    @property
    def charge_class(self) -> ChargeClass:
        return self._cls

    @property
    def is_dispatched(self) -> bool:
        return self._is_dispatched

    def charged_s(self, now: float) -> float:
        meter = self._meter
        if meter is None or not self._is_dispatched:
            return self._charged_s
        return self._charged_s + meter.value(self._cls, now) - self._charge0

    def queue_s(self, now: float) -> float:
        meter = self._meter
        if meter is None or self._is_dispatched:
            return self._queue_s
        return self._queue_s + meter.value(ChargeClass.FREE, now) - self._charge0

    def is_charging(self) -> bool:
        meter = self._meter
        return meter is not None and self._is_dispatched and meter.is_running(self._cls)

    def timeout_v(self) -> float:
        """Virtual time (current class) at which the charged time reaches `timeout_s`."""
        return self._charge0 + self.timeout_s - self._charged_s

    def stall_v(self, allowance_s: float = 0.0) -> float:
        """Virtual time at which the stall window (plus `allowance_s`, e.g. its own prefill) runs out."""
        meter = self._meter
        start = self.progress_v if meter is None else max(self.progress_v, meter.mark(self._cls))
        return start + self.stall_timeout_s + allowance_s

    def queue_v(self, queue_timeout_s: float) -> float:
        """Virtual time of the pool meter at which the queue time reaches `queue_timeout_s`."""
        return self._charge0 + queue_timeout_s - self._queue_s

    def deadline_at(self, now: float) -> float:
        """Real time at which the charged time reaches `timeout_s` if nothing changes; inf while not charging."""
        meter = self._meter
        if meter is None or not self._is_dispatched:
            return math.inf
        return meter.real_at(self._cls, self.timeout_v(), now)

    def wall_deadline_at(self, max_wall_s: float) -> float:
        """When the wall clock reaches `max_wall_s`."""
        return self.arrived_at + max_wall_s

    def wallclock_deadline_at(self) -> float:
        """WALLCLOCK mode (the incident's proxy): the timeout counts wall time from arrival."""
        return self.arrived_at + self.timeout_s

    def breakdown(self, now: float, *, attempts: int, engine_id: str | None, tokens: int) -> TimingBreakdown:
        """The timing so far (or the final one after `finish`)."""
        at = min(now, self._ended_at)
        meter = self._meter
        queue_s, paused_q, paused_d = self._queue_s, self._paused_queued_s, self._paused_dispatched_s
        dispatched_s, charged_s, stall_s = self._dispatched_s, self._charged_s, self._stall_s
        if meter is not None:
            paused = meter.paused_value(at) - self._paused0
            charge = meter.value(self._cls, at) - self._charge0
            if self._is_dispatched:
                dispatched_s += at - self._stint_at
                paused_d += paused
                charged_s += charge
                stall_s = at - self.progress_at
            else:
                queue_s += charge
                paused_q += paused
        return TimingBreakdown(
            wall_s=at - self.arrived_at,
            queue_s=queue_s,
            paused_s=paused_q + paused_d,
            contention_s=max(0.0, dispatched_s - paused_d - charged_s - self._forgiven_s),
            charged_s=charged_s,
            forgiven_s=self._forgiven_s,
            stall_s=stall_s,
            dispatched_s=dispatched_s,
            attempts=attempts,
            engine_id=engine_id,
            tokens=tokens,
        )

    def __repr__(self) -> str:
        where = "dispatched" if self._is_dispatched else "queued" if self._meter is not None else "idle"
        return f"<RequestClock {where} charged={self._charged_s:.3f}s queue={self._queue_s:.3f}s>"
