"""A synchronous harness around `Gateway` on a ManualClock: events in, commands recorded, time stepped.

`Harness.advance(s, streams=...)` moves time forward, firing the core's deadlines exactly when they fall and
delivering periodic progress for the requests named in `streams` (request id -> seconds between progress
events), in time order, like a driver and engines would. Nothing sleeps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from rolloutgate.core.clock import ManualClock
from rolloutgate.core.commands import Abort, Command, Complete, Dispatch, Fail, MarkEngine
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import (
    EngineJoined,
    Event,
    ProgressReported,
    RequestArrived,
    RequestLimits,
    UpstreamFinished,
)
from rolloutgate.core.gateway import Gateway

C = TypeVar("C", Dispatch, Abort, Fail, Complete, MarkEngine)


def of(commands: Iterable[Command], kind: type[C]) -> list[C]:
    return [c for c in commands if isinstance(c, kind)]


# The rules' reference world: sessions stay where they are, every prefill counts against the budget, no rest
# after long prefills, a silent engine judged hung at once, its first work as any other (no warm-up). The
# production defaults (GatewayCoreConfig()) add prefill-aware placement, the pause check and the warm-up on
# top; their tests name them (test_placement_prefill_aware.py, test_prefill_*, test_gateway_liveness.py's
# pause check, test_warmup.py).
REFERENCE = GatewayCoreConfig(
    placement="session_affinity",
    prefill_budget_exempt_tokens=0,
    prefill_rest_ratio=0.0,
    hang_check_s=0.0,
    warmup_timeout_s=0.0,
)


def reference(**changes: Any) -> GatewayCoreConfig:
    """The reference world with these settings changed."""
    return dataclasses.replace(REFERENCE, **changes)


class Harness:
    def __init__(self, config: GatewayCoreConfig | None = None, *, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        self.gw = Gateway(config or REFERENCE)
        self.log: list[tuple[float, Command]] = []
        self.engine_of: dict[str, str] = {}  # request id -> engine of its latest dispatch
        self.attempt_of: dict[str, int] = {}
        self.observer: Callable[[list[Command]], None] | None = None  # sees each call's commands

    @property
    def now(self) -> float:
        return self.clock.now()

    def _record(self, commands: list[Command]) -> list[Command]:
        for c in commands:
            self.log.append((self.now, c))
            if isinstance(c, Dispatch):
                self.engine_of[c.request_id] = c.engine_id
                self.attempt_of[c.request_id] = c.attempt
        if self.observer is not None:
            self.observer(commands)
        return commands

    def send(self, event: Event) -> list[Command]:
        return self._record(self.gw.handle(event, self.now))

    def engines(self, **capacities: int) -> None:
        for engine_id, capacity in capacities.items():
            self.send(EngineJoined(engine_id=engine_id, capacity=capacity))

    def arrive(self, request_id: str, **kwargs: object) -> list[Command]:
        limits = kwargs.pop("limits", None)
        if limits is None:
            limit_args = {k: kwargs.pop(k) for k in list(kwargs) if k.endswith("_s")}
            limits = RequestLimits(**limit_args)  # type: ignore[arg-type]
        return self.send(RequestArrived(request_id=request_id, limits=limits, **kwargs))  # type: ignore[arg-type]

    def progress(self, request_id: str, tokens: int = 1) -> list[Command]:
        return self.send(ProgressReported(request_id=request_id, tokens=tokens))

    def finish(self, request_id: str) -> list[Command]:
        return self.send(UpstreamFinished(request_id=request_id))

    def fire(self) -> list[Command]:
        return self._record(self.gw.on_time(self.now))

    def next_deadline(self) -> float:
        return self.gw.next_deadline()

    def advance(self, seconds: float, streams: Mapping[str, float] | None = None) -> list[Command]:
        """Move time by `seconds`, firing deadlines and delivering stream progress in time order."""
        target = self.now + seconds
        streams = dict(streams or {})
        next_tick = {rid: self.now + period for rid, period in streams.items()}
        out: list[Command] = []
        for _ in range(1_000_000):
            tick_rid, tick_at = min(next_tick.items(), key=lambda kv: kv[1], default=(None, math.inf))
            deadline = self.next_deadline()
            step_at = min(tick_at, deadline)
            if step_at > target:
                break
            self.clock.advance(max(0.0, step_at - self.now))
            if deadline <= tick_at:
                out += self.fire()
            else:
                assert tick_rid is not None
                out += self.progress(tick_rid)
                next_tick[tick_rid] = tick_at + streams[tick_rid]
        else:  # pragma: no cover - a deadline that never clears is a core bug
            raise AssertionError("deadline loop did not settle")
        self.clock.advance(target - self.now)
        out += self.fire()
        return out

    def commands(self, kind: type[C], request_id: str | None = None) -> list[C]:
        found = [c for _, c in self.log if isinstance(c, kind)]
        if request_id is not None:
            found = [c for c in found if getattr(c, "request_id", None) == request_id]
        return found

    def ended(self, request_id: str) -> list[Command]:
        """The Complete/Fail commands emitted for a request (exactly one once it ended)."""
        return [c for _, c in self.log if isinstance(c, (Complete, Fail)) and c.request_id == request_id]


class DeferringHarness(Harness):
    """The driver's way: events handled with `defer_deadlines`, the deadlines recomputed once before time
    moves on (the driver flushes at the end of each loop iteration, before any timer can fire)."""

    def send(self, event: Event) -> list[Command]:
        return self._record(self.gw.handle(event, self.now, defer_deadlines=True))

    def fire(self) -> list[Command]:
        self.gw.flush_deadlines(self.now)
        return super().fire()

    def next_deadline(self) -> float:
        self.gw.flush_deadlines(self.now)
        return super().next_deadline()
