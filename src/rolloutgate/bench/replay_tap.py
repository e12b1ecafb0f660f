"""A gateway with a measuring tap: which client HTTP attempt became which gateway request, and how each ended.

Theory of operation: the replay needs to join three views of one turn: the agent's (one LiteLLM call, with
its hidden retries), the gateway's (one request id per client attempt, its verdict) and the engine's (one
generation per dispatch, rid `<request id>-<attempt>`, see server/driver.py `upstream_id`). The gateway is
built exactly as `GatewayServer` builds it; the tap only observes:

- an outermost middleware records each client attempt: its turn tag (`X-Replay-Turn`), LiteLLM's retry count
  (`x-stainless-retry-count`), when it arrived and ended, its status, and whether the client went away first
  (aiohttp cancels the handler when the connection closes);
- the driver's `submit` is wrapped to learn the request id given to the attempt being handled (a context
  variable set by the middleware); an attempt that attached to an earlier request learns it from the
  `X-Rolloutgate-Request-Id` response header;
- the driver's `on_end` callbacks record each request's verdict (answer or error code) and timing;
- the core's `handle` and `on_time` are wrapped to see every `MarkEngine` command it returns (quarantined,
  unhealthy, healthy), which gives the time a frozen engine was detected.

All times are the simulator's clock (simulated seconds), so the three views share one time line.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rolloutgate.config import GatewaySettings
from rolloutgate.core.commands import Command, MarkEngine
from rolloutgate.core.gateway import Gateway
from rolloutgate.server.app import build_app
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.exchange import Exchange, Finished

__all__ = ("AttemptRecord", "EngineMark", "RequestEnd", "TappedGateway")

TURN_HEADER = "X-Replay-Turn"
_CURRENT: contextvars.ContextVar[AttemptRecord | None] = contextvars.ContextVar(
    "replay_attempt", default=None
)


@dataclass(slots=True)
class AttemptRecord:
    """One client HTTP attempt as the gateway received it."""

    tag: str
    retry_count: int
    arrived_at: float
    path: str
    request_id: str | None = None
    ended_at: float | None = None
    status: int | None = None
    client_gone: bool = False  # the client closed the connection before the answer was written

    def to_json(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "retry_count": self.retry_count,
            "arrived_at": self.arrived_at,
            "path": self.path,
            "request_id": self.request_id,
            "ended_at": self.ended_at,
            "status": self.status,
            "client_gone": self.client_gone,
        }


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

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "at": self.at,
            "ok": self.ok,
            "code": self.code,
            "status": self.status,
            "engine_url": self.engine_url,
            "timing": self.timing,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMark:
    at: float
    engine_url: str | None
    state: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "engine_url": self.engine_url, "state": self.state, "detail": self.detail}


@dataclass(eq=False)
class TappedGateway:
    """Run the gateway of `settings` on 127.0.0.1 with the tap; times from `now` (simulated seconds)."""

    settings: GatewaySettings
    now: Callable[[], float]
    attempts: list[AttemptRecord] = field(default_factory=list)
    ends: dict[str, RequestEnd] = field(default_factory=dict)
    marks: list[EngineMark] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _app: web.Application | None = None

    @property
    def context(self) -> GatewayContext:
        assert self._app is not None
        return self._app[CONTEXT]

    async def start(self) -> str:
        app = build_app(self.settings)
        app.middlewares.insert(0, self._middleware)
        ctx = app[CONTEXT]
        driver = ctx.driver
        submit = driver.submit

        def tapped_submit(exchange: Exchange, arrived: Any) -> None:
            record = _CURRENT.get()
            if record is not None and record.request_id is None:
                record.request_id = exchange.request_id
            submit(exchange, arrived)

        driver.submit = tapped_submit  # type: ignore[method-assign]
        driver.on_end.append(self._on_end)
        driver.core = _TappedCore(driver.core, self._look)  # type: ignore[assignment]
        self._app = app
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- observers ---------------------------------------------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        tag = request.headers.get(TURN_HEADER)
        if tag is None:
            return await handler(request)
        try:
            retry_count = int(request.headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            retry_count = -1
        record = AttemptRecord(tag=tag, retry_count=retry_count, arrived_at=self.now(), path=request.path)
        self.attempts.append(record)
        token = _CURRENT.set(record)
        try:
            response = await handler(request)
            record.status = response.status
            if record.request_id is None:
                record.request_id = response.headers.get("X-Rolloutgate-Request-Id")
            return response
        except asyncio.CancelledError:
            record.client_gone = True
            raise
        except web.HTTPException as exc:
            record.status = exc.status
            raise
        finally:
            record.ended_at = self.now()
            _CURRENT.reset(token)

    def _on_end(self, exchange: Exchange, item: Any) -> None:
        ok = isinstance(item, Finished)
        timing = item.timing.as_dict() if getattr(item, "timing", None) is not None else None
        self.ends[exchange.request_id] = RequestEnd(
            request_id=exchange.request_id,
            at=self.now(),
            ok=ok,
            code="ok" if ok else str(getattr(item, "code", "error")),
            status=200 if ok else int(getattr(item, "status", 500)),
            engine_url=exchange.engine_url,
            timing=timing,
        )

    def _look(self, commands: list[Command]) -> list[Command]:
        for command in commands:
            if isinstance(command, MarkEngine):
                handle = self.context.pool.engines.get(command.engine_id)
                self.marks.append(
                    EngineMark(
                        at=self.now(),
                        engine_url=None if handle is None else handle.url,
                        state=command.state,
                        detail=command.detail,
                    )
                )
        return commands


class _TappedCore:
    """The driver's core with its verdicts looked at (`look`) on their way to the driver; everything else is
    the core's own. A wrapper rather than patched methods: the compiled core's methods cannot be replaced
    (core/_native.py)."""

    def __init__(self, core: Gateway, look: Callable[[list[Command]], list[Command]]) -> None:
        self._core = core
        self._look = look

    def handle(self, event: Any, now: float, *, defer_deadlines: bool = False) -> list[Command]:
        return self._look(self._core.handle(event, now, defer_deadlines=defer_deadlines))

    def on_time(self, now: float) -> list[Command]:
        return self._look(self._core.on_time(now))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)
