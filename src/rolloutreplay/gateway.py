"""What the replay records of its gateway: the production `GatewayServer` (server/app.py), only looked at.

Theory of operation: the replay runs the gateway `rolloutgate serve` runs (the same app, header limits,
slow-reader watchdog and graceful stop), its settings the only difference (world.py `gateway_settings`).
`GatewayRecorder` attaches to it once it started and only looks, through the driver's public hooks
(server/driver.py):

- an observer sees every verdict of the core: each `RequestArrived` gives a request's id and routing key (the
  agent's session, which attempts.py joins to the client's attempts), each `MarkEngine` command an engine's
  new state (quarantined, unhealthy, healthy: when a frozen engine was detected);
- the `on_end` callbacks give each request's verdict (answer or error code) and timing.

All times are the simulator's clock (simulated seconds), the agents' and the engines' time line too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.core.commands import Command, MarkEngine
from rolloutgate.core.events import Event, RequestArrived
from rolloutgate.errors import GatewayError
from rolloutgate.server.context import GatewayContext
from rolloutgate.server.exchange import Exchange, Finished

__all__ = ("EngineMark", "GatewayRecorder", "RequestEnd")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestEnd:
    """A gateway request's verdict."""

    request_id: str
    at: float
    ok: bool
    code: str  # "ok" or the error code (timeout, no_engine, ...)
    status: int
    engine_url: str | None
    timing: dict[str, Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMark:
    at: float
    engine_url: str | None
    state: str
    detail: str


@dataclass(eq=False)
class GatewayRecorder:
    """Records arrivals, verdicts and engine marks of the started gateway of `context`; times from `now`."""

    context: GatewayContext
    now: Callable[[], float]
    arrivals: list[tuple[float, str, str | None]] = field(
        default_factory=list
    )  # (at, request id, routing key)
    ends: dict[str, RequestEnd] = field(default_factory=dict)
    marks: list[EngineMark] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.context.driver.observers.append(self._observe)
        self.context.driver.on_end.append(self._on_end)

    def _observe(self, _gateway_time: float, event: Event | None, commands: list[Command]) -> None:
        if isinstance(event, RequestArrived):
            self.arrivals.append((self.now(), event.request_id, event.routing_key))
        for command in commands:
            if isinstance(command, MarkEngine):
                engine = self.context.pool.engines.get(command.engine_id)
                self.marks.append(
                    EngineMark(
                        at=self.now(),
                        engine_url=None if engine is None else engine.url,
                        state=command.state,
                        detail=command.detail,
                    )
                )

    def _on_end(self, exchange: Exchange, item: Finished | GatewayError) -> None:
        code, status = ("ok", 200) if isinstance(item, Finished) else (item.code, item.status)
        self.ends[exchange.request_id] = RequestEnd(
            request_id=exchange.request_id,
            at=self.now(),
            ok=isinstance(item, Finished),
            code=code,
            status=status,
            engine_url=exchange.engine_url,
            timing=None if item.timing is None else item.timing.as_dict(),
        )
