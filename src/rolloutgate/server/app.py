"""The aiohttp application: wiring of settings, core, driver, pool and routes; errors become OpenAI JSON.

`GatewayServer` runs the app on a host and port (port 0: ephemeral), optionally with simulated engines in the
same process (`--sim N`), and stops everything in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.events import ClockMode
from rolloutgate.core.gateway import Gateway, GatewayCoreConfig
from rolloutgate.engines.base import UpstreamError
from rolloutgate.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge
from rolloutgate.server import admin, front, workers
from rolloutgate.server.attach import Attachments
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.driver import Driver, GatewayClock
from rolloutgate.server.exchange import Exchange, Finished
from rolloutgate.server.metrics import Metrics
from rolloutgate.server.pool import EnginePool
from rolloutgate.server.sessions_mount import mount_sessions

__all__ = ("GatewayServer", "build_app")

log = logging.getLogger("rolloutgate")
request_log = logging.getLogger("rolloutgate.requests")


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as error:
        if error.status < 500:
            ctx = request.app.get(CONTEXT)
            if ctx is not None:
                ctx.metrics.bad_requests.labels(code=error.code).inc()
        return web.Response(status=error.status, body=error.body(), headers=error.headers())
    except web.HTTPException as exc:
        if exc.status == 413:
            error = PayloadTooLarge(exc.text or "request body too large")
        elif exc.status == 404:
            error = NotFound(f"no route for {request.method} {request.path}")
        elif exc.status < 400:
            raise
        else:
            error = BadRequest(exc.reason, status=exc.status, code=exc.reason.lower().replace(" ", "_"))
        return web.Response(status=error.status, body=error.body(), headers=error.headers())
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except ValueError as exc:  # e.g. a malformed header value aiohttp refused to parse
        error = BadRequest(str(exc))
        return web.Response(status=error.status, body=error.body(), headers=error.headers())
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        error = GatewayError("internal gateway error")
        return web.Response(status=500, body=error.body(), headers=error.headers())


def _core_config(settings: GatewaySettings) -> GatewayCoreConfig:
    return GatewayCoreConfig(
        clock_mode=ClockMode(settings.clock),
        max_queue=settings.max_queue,
        max_attempts=settings.max_attempts,
        no_engine_grace_s=settings.no_engine_grace,
        retry_grace_s=settings.retry_grace,
        contention_min_prefill_tokens=settings.contention_min_prefill_tokens,
        affinity_max_excess=settings.affinity_max_excess,
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


def build_app(settings: GatewaySettings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[errors_middleware])
    clock = GatewayClock(settings.time_scale)
    metrics = Metrics()
    driver = Driver(
        Gateway(_core_config(settings)),
        clock,
        metrics,
        progress_every_tokens=settings.progress_every_tokens,
        abort_upstream=settings.clock == "engine",
    )
    driver.on_end.append(_log_request)
    pool = EnginePool(settings, driver.handle, clock.real_seconds)
    driver.pool = pool
    attachments = Attachments(ttl_s=settings.result_ttl, max_entries=settings.result_cache_entries)
    driver.on_end.append(lambda exchange, item: attachments.ended(exchange, item, clock.now()))
    driver.on_forget.append(attachments.forget)
    ctx = GatewayContext(
        settings=settings, metrics=metrics, driver=driver, pool=pool, attachments=attachments
    )
    metrics.watch(lambda: _state(ctx))
    app[CONTEXT] = ctx
    app.cleanup_ctx.append(_lifecycle)
    front.add_routes(app)
    workers.add_routes(app)
    admin.add_routes(app)
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
        from rolloutgate.sim import SimCluster

        cluster = SimCluster(
            engines=settings.sim,
            api=settings.sim_api,
            profile=settings.sim_profile,
            time_scale=settings.time_scale,
        )
        await cluster.__aenter__()
        ctx.extras["sim"] = cluster
        specs += [EngineSpec(url=url, family=settings.sim_api) for url in cluster.urls]
    retry_s = driver.clock.real_seconds(settings.health_interval)
    joiners = [asyncio.create_task(_join(pool, spec, retry_s)) for spec in specs]
    # Wait briefly so a healthy pool is ready when the server starts answering; stragglers keep retrying.
    if joiners:
        await asyncio.wait(joiners, timeout=30)
    try:
        yield
    finally:
        for task in joiners:
            task.cancel()
        await driver.close()
        await pool.close()
        await session.close()
        if cluster is not None:
            await cluster.__aexit__(None, None, None)


async def _join(pool: EnginePool, spec: EngineSpec, retry_s: float) -> None:
    """Add an engine, retrying while it cannot be reached (DNS, refused) so start-up order does not matter."""
    while True:
        try:
            await pool.add(spec)
            return
        except UpstreamError as exc:
            log.warning("engine %s not reachable yet (%s); retrying", spec.url, exc.message)
            await asyncio.sleep(retry_s)


def _state(ctx: GatewayContext) -> dict[str, Any]:
    stats = ctx.driver.core.stats()
    return {
        "queue_depth": stats.queue_depth,
        "in_flight": dict(stats.in_flight),
        "engine_states": {e.engine_id: e.state for e in ctx.pool.engines.values()},
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

    async def start(self) -> str:
        self.app = build_app(self.settings)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.host, self.settings.port, backlog=4096)
        await site.start()
        sockets = site._server.sockets if site._server else []
        port = sockets[0].getsockname()[1] if sockets else self.settings.port
        self.url = f"http://{self.settings.host}:{port}"
        return self.url

    @property
    def context(self) -> GatewayContext:
        return self.app[CONTEXT]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
