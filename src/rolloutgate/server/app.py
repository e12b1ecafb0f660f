"""The aiohttp application: wiring of settings, core, driver, pool and routes; errors become OpenAI JSON.

`GatewayServer` runs the app on a host and port (port 0: ephemeral), optionally with simulated engines in the
same process (`--sim N`), and stops everything in order.

Graceful shutdown (`GatewayServer.stop`, on SIGTERM): stop accepting connections; answer new requests on
open connections with 503 + Retry-After (so clients retry on another replica); give the requests in flight
`shutdown_grace` to finish; then end the rest with a 503 (framed in-body if keep-alive already sent a 200)
and abort their generations on the engines; then close. Bounded: grace + `HAND_BACK_S` + engine aborts.

Slow readers: aiohttp's writes wait for the socket to drain, so a client that stops reading blocks its
handler (and keeps its exchange alive) for as long as it keeps the connection open. A watchdog cuts a client
whose written bytes stay unread for `client_write_timeout`; the handler then sees a disconnect, and the
usual retry grace and upstream abort follow. (A client that falls `client_buffer_bytes` behind a live stream
is cut off sooner, by its exchange: server/exchange.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.events import ClockMode
from rolloutgate.core.gateway import Gateway, GatewayCoreConfig
from rolloutgate.errors import GatewayError, Unavailable
from rolloutgate.runtime_clock import LoopClock
from rolloutgate.server import (
    admin,
    engine_metrics,
    fan_out,
    finish_session,
    front,
    groups,
    rl_plane,
    weight_update,
    workers,
)
from rolloutgate.server.attach import Attachments
from rolloutgate.server.cache_hits import observe_cache_hits
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.driver import Driver
from rolloutgate.server.engine_handle import PENDING
from rolloutgate.server.exchange import Exchange, Finished
from rolloutgate.server.loop_lag import LoopLagWatch
from rolloutgate.server.metrics import Metrics
from rolloutgate.server.pool import EnginePool
from rolloutgate.server.sessions_mount import mount_sessions
from rolloutgate.server.trace import attach_trace

__all__ = ("GatewayServer", "build_app", "core_config")

log = logging.getLogger("rolloutgate")
request_log = logging.getLogger("rolloutgate.requests")
http_log = logging.getLogger("rolloutgate.http")

HAND_BACK_S = 5.0  # real seconds, after the grace, for handlers to write their 503s before they are cut


class _HttpErrorLog:
    """The logger aiohttp's protocol handler uses: malformed requests (oversized headers, bad request lines)
    are logged as one line naming the error type, never with aiohttp's excerpt of the offending bytes, which
    can hold a token or part of a body."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):  # the client's malformed request: one line, no bytes
            self._log.warning("%s: %s", msg % args if args else msg, _describe(exc_info))
        else:  # a gateway bug: keep the traceback
            self._log.error(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("%s: %s", msg % args if args else msg, _describe(exc_info))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def _describe(exc_info: Any) -> str:
    if isinstance(exc_info, BaseException):
        status = getattr(exc_info, "code", None) or getattr(exc_info, "status", None)
        return f"{type(exc_info).__name__}" + (f" (HTTP {status})" if status else "")
    return "no details"


def core_config(settings: GatewaySettings) -> GatewayCoreConfig:
    """The core's settings from the gateway's (the one way; the defaults are the core's own)."""
    return GatewayCoreConfig(
        clock_mode=ClockMode(settings.clock),
        max_queue=settings.max_queue,
        max_attempts=settings.max_attempts,
        no_engine_grace_s=settings.no_engine_grace,
        retry_grace_s=settings.retry_grace,
        contention_min_prefill_tokens=settings.contention_min_prefill_tokens,
        affinity_max_excess=settings.affinity_max_excess,
        session_idle_s=math.inf if settings.session_binding_idle is None else settings.session_binding_idle,
        session_max_in_flight=(
            math.inf if settings.session_max_in_flight is None else settings.session_max_in_flight
        ),
        placement=settings.placement,
        engine_cache_tokens=(
            math.inf if settings.engine_cache_tokens is None else settings.engine_cache_tokens
        ),
        # the budget governs the prefills that contend (docs/prefill.md); smaller ones need only a slot
        prefill_budget_exempt_tokens=settings.contention_min_prefill_tokens,
        prefill_rest_ratio=settings.prefill_rest_ratio,
        hang_check_s=settings.hang_check_timeout,
        warmup_timeout_s=settings.warmup_timeout,
        max_staleness=settings.max_staleness,
        on_stale=settings.on_stale,
        pace_batch=settings.pace_batch,
    )


def _log_request(exchange: Exchange, outcome: Finished | GatewayError) -> None:
    """One structured line per request: ids, route, outcome, engine and the timing breakdown; no bodies."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    if isinstance(outcome, Finished):
        record: dict[str, Any] = {"outcome": "ok", "status": 200, "timing": outcome.timing.as_dict()}
    else:
        timing = outcome.timing.as_dict() if outcome.timing is not None else None
        record = {"outcome": outcome.code, "status": outcome.status, "timing": timing}
    record.update(request_id=exchange.request_id, route=exchange.route.value, engine=exchange.engine_url)
    request_log.info(orjson.dumps(record).decode())


def engine_poll_interval(settings: GatewaySettings) -> float:
    """Gateway seconds between load readings of a watched engine: a frozen engine is caught at most this
    much after `stall_timeout` (core/engine_watch.py)."""
    if settings.engine_poll_interval is not None:
        return settings.engine_poll_interval
    return min(settings.stall_timeout / 20, 3.0)


def build_app(settings: GatewaySettings) -> web.Application:
    # No middleware: every route is registered behind server/guard.py instead (aiohttp adds frames per middleware).
    app = web.Application(client_max_size=settings.max_body_bytes)
    clock = LoopClock(settings.time_scale)
    metrics = Metrics()
    driver = Driver(
        Gateway(core_config(settings)),
        clock,
        metrics,
        abort_upstream=settings.clock == "engine",
        engine_poll_s=clock.real_seconds(engine_poll_interval(settings)),
        checkpoint_tokens=settings.checkpoint_tokens,
        rerun_engine_pause_aborts=settings.engine_pause_aborts == "rerun",
    )
    driver.on_end.append(_log_request)
    driver.on_end.append(partial(observe_cache_hits, metrics))
    pool = EnginePool(
        settings, driver.handle, clock.real_seconds, driver.core.engine_state, driver.core.in_flight_on
    )
    pool.output_at = driver.engine_watch.output_at
    driver.pool = pool
    attachments = Attachments(ttl_s=settings.result_ttl, max_entries=settings.result_cache_entries)
    driver.on_end.append(lambda exchange, item: attachments.ended(exchange, item, clock.now()))
    driver.on_forget.append(attachments.forget)
    ctx = GatewayContext(
        settings=settings, metrics=metrics, driver=driver, pool=pool, attachments=attachments
    )
    metrics.watch(lambda: _state(ctx))
    if settings.record_trace:
        ctx.extras["trace"] = attach_trace(settings, driver, pool)
    app[CONTEXT] = ctx
    app.cleanup_ctx.append(_lifecycle)
    front.add_routes(app)
    workers.add_routes(app)
    admin.add_routes(app)
    weight_update.add_routes(app)
    groups.add_routes(app)
    finish_session.add_routes(app)
    fan_out.add_routes(app)
    rl_plane.add_routes(app)
    engine_metrics.add_routes(app)
    mount_sessions(app)
    front.add_proxy_route(app)
    return app


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Start-up: the upstream HTTP session, embedded simulated engines, the engine pool; then the reverse."""
    ctx = app[CONTEXT]
    settings, driver, pool = ctx.settings, ctx.driver, ctx.pool
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    session = aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), json_serialize=_dumps_str
    )
    ctx.session = pool.session = session
    cluster = None
    specs = list(settings.engines)
    if settings.sim:
        from rolloutsim import SimCluster

        cluster = SimCluster(
            engines=settings.sim,
            api=settings.sim_api,
            profile=settings.sim_profile,
            time_scale=settings.time_scale,
            # the tokenizer the gateway renders with is the model the simulated engines play: its ids fit
            vocab_size=pool.vocab_size,
            model_path=settings.tokenizer,
        )
        await cluster.__aenter__()
        ctx.extras["sim"] = cluster
        specs += [EngineSpec(url=url, family=settings.sim_api) for url in cluster.urls]
    registrations = [asyncio.create_task(pool.register(spec)) for spec in specs]
    # Wait until every engine joined or failed once (bounded), so a reachable pool is ready when the server
    # starts answering and an unreachable engine (refused, DNS) does not hold start-up: it is kept pending and
    # probed again every health_interval (server/pool.py).
    if registrations:
        await asyncio.wait(registrations, timeout=30)
    lag_watch = LoopLagWatch(ctx.metrics.loop_lag)
    lag_watch.start()
    try:
        yield
    finally:
        lag_watch.stop()
        for task in registrations:
            task.cancel()
        await driver.close()
        if "trace" in ctx.extras:
            ctx.extras["trace"].close()  # after the last request ended (GatewayServer.stop)
        await pool.close()
        await session.close()
        if cluster is not None:
            await cluster.__aexit__(None, None, None)


def _state(ctx: GatewayContext) -> dict[str, Any]:
    stats = ctx.driver.core.stats()
    return {
        "queue_depth": stats.queue_depth,
        "in_flight": dict(stats.in_flight),
        # a registered engine that has not joined is not in the core yet (server/pool.py)
        "engine_states": {**{p.engine_id: PENDING for p in ctx.pool.pending.values()}, **stats.engine_states},
        "queue_oldest_s": ctx.driver.core.oldest_queued_s(ctx.driver.clock.now()),
        "gate": stats.gate,
    }


def _dumps_str(value: Any) -> str:
    return orjson.dumps(value).decode()


@dataclass
class GatewayServer:
    """Run the gateway on host:port until `stop()`; `url` is known after `start()`."""

    settings: GatewaySettings
    app: web.Application = field(init=False)
    runner: web.AppRunner | None = None
    url: str = ""
    # Called with the built app before it serves: what wraps the gateway (rolloutgate.fleet) adds its
    # middleware and signals here.
    configure_app: Callable[[web.Application], None] | None = None
    # a port it also listens on with SO_REUSEPORT, beside its own: the gateways on one host that share it
    # take its connections in turn, and one that dies leaves it to the others (a fleet's one URL)
    shared_port: int | None = None
    _hurry: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _watchdog: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    async def start(self) -> str:
        self.app = build_app(self.settings)
        if self.configure_app is not None:
            self.configure_app(self.app)
        self.runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=HAND_BACK_S,
            max_line_size=self.settings.max_header_bytes,
            max_field_size=self.settings.max_header_bytes,
            max_headers=self.settings.max_headers,
            logger=_HttpErrorLog(http_log),
        )
        await self.runner.setup()
        self._watchdog = asyncio.create_task(self._cut_stalled_readers(), name="stalled-readers")
        site = web.TCPSite(self.runner, self.settings.host, self.settings.port, backlog=4096)
        await site.start()
        if self.shared_port is not None:
            shared = web.TCPSite(
                self.runner, self.settings.host, self.shared_port, backlog=4096, reuse_port=True
            )
            await shared.start()
        addresses = self.runner.addresses  # getsockname() of each listening socket, its own site's first
        port = addresses[0][1] if addresses else self.settings.port
        self.url = f"http://{self.settings.host}:{port}"
        return self.url

    @property
    def context(self) -> GatewayContext:
        return self.app[CONTEXT]

    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown (module docstring). `grace_s`: real seconds for in-flight requests to finish
        (default: the `shutdown_grace` setting, in gateway seconds); `hurry()` cuts it short."""
        runner = self.runner
        if runner is None:
            return
        self.runner = None
        ctx = self.context
        ctx.draining = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for site in list(runner.sites):
            await site.stop()  # no new connections; open ones get 503 for new requests
        if grace_s is None:
            grace_s = ctx.driver.clock.real_seconds(self.settings.shutdown_grace)
        in_flight = ctx.active_requests
        if in_flight:
            log.info("shutting down: %d requests in flight get %.1f s to finish", in_flight, grace_s)
            await self._drained(grace_s)
        handed_back = ctx.driver.fail_all(
            lambda: Unavailable(
                "the gateway shut down before this request finished; retry it", retry_after_s=1
            )
        )
        if handed_back:
            log.warning("shutdown: %d unfinished requests answered 503 and aborted upstream", handed_back)
        await runner.cleanup()

    async def _cut_stalled_readers(self) -> None:
        """Abort connections whose write buffer stayed non-empty (nothing read) on every check for
        `client_write_timeout`."""
        runner = self.runner
        assert runner is not None and runner.server is not None
        server = runner.server
        timeout_s = self.settings.client_write_timeout  # real seconds: clients read in real time
        period_s = min(1.0, timeout_s / 4)
        loop = asyncio.get_running_loop()
        behind_since: dict[int, float] = {}
        while True:
            await asyncio.sleep(period_s)
            now = loop.time()
            still_behind: dict[int, float] = {}
            for connection in server.connections:
                transport = connection.transport
                if transport is None or transport.is_closing() or not transport.get_write_buffer_size():
                    continue
                since = behind_since.get(id(transport), now)
                if now - since < timeout_s:
                    still_behind[id(transport)] = since
                    continue
                log.warning(
                    "cutting off a client that left its answer unread for %.0f s (peer %s)",
                    now - since,
                    transport.get_extra_info("peername"),
                )
                transport.abort()
            behind_since = still_behind

    def hurry(self) -> None:
        """End a graceful shutdown's grace period now (e.g. a second SIGTERM)."""
        self._hurry.set()

    async def _drained(self, grace_s: float) -> None:
        ctx = self.context
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while ctx.active_requests and not self._hurry.is_set() and loop.time() < end:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(0.05, max(0.0, end - loop.time()))):
                    await self._hurry.wait()

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
