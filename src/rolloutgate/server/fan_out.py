"""SGLang's `/abort_request` and `/flush_cache` through the gateway: to every engine, not to one.

miles ends every rollout step with `POST /abort_request {"abort_all": true}` (reference/miles.md) and waits
for every pending call. Sent to one engine, it would miss the calls still waiting in the gateway, which would
then start and run to their end while miles waits. Here an `abort_all` first ends every call waiting in the
gateway (`QueueAborted`: a `/generate` gets SGLang's own answer for a call aborted while it waited, finish
reason abort, at once; other routes a 400 `aborted`), then goes to every SGLang engine of the pool, which
answers what it runs itself (finish reason abort, with the output so far). A `rid` is the client's own (calls
carry it upstream as the lead of their engine id, server/driver.py `upstream_id`): the gateway's calls with
that rid (or, with `"prefix": true`, starting with it) end the same way, waiting or running. The body also
goes to every SGLang engine as it came, for calls made to the engines directly. The answer is SGLang's: an
empty 200.

Who may call them: an admin, or the cluster's own machines (`--trust-network`), which is where miles sends
them from, with no token.

A call dispatched but not yet at its engine when the engine takes the abort is not aborted (a window of one
loopback send).

`/flush_cache` (miles flushes before scoring, and its trainer after a weight update) goes to every SGLang
engine with its query (`?timeout=`); each engine that flushed is reported `EngineCacheFlushed` (placement then
prices its sessions' next turns as cold prefills). SGLang's answer: 200 `Cache flushed.` when every engine
flushed, else 400 naming the ones that did not (an engine flushes only when idle).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import aiohttp
from aiohttp import web

from rolloutgate.core.events import EngineCacheFlushed, QueueAborted
from rolloutgate.engines.base import EngineFamily, UpstreamError
from rolloutgate.engines.http import post_json, status_of
from rolloutgate.errors import BadRequest
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_worker_admin
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded
from rolloutgate.server.validate import parse_body

__all__ = ("abort_requests", "add_routes", "flush_caches")

log = logging.getLogger("rolloutgate.fan_out")

ENGINE_CALL_S = 10.0  # real seconds each engine has to take the abort


async def abort_requests(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /abort_request` (module docstring)."""
    ctx = app[CONTEXT]
    abort_all = body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise BadRequest("'abort_all' must be a boolean", param="abort_all", code="invalid_type")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("'rid' must be a string", param="rid", code="invalid_type")
    prefix = body.get("prefix", False)
    if not isinstance(prefix, bool):
        raise BadRequest("'prefix' must be a boolean", param="prefix", code="invalid_type")
    if abort_all:
        ctx.driver.handle(QueueAborted())
        ctx.driver.abort_all_ordered()
    elif rid:
        ctx.driver.abort_client_rid(rid, prefix=prefix)
    engines = [e for e in ctx.pool.engines.values() if e.info.family is EngineFamily.SGLANG]
    limits = aiohttp.ClientTimeout(total=ENGINE_CALL_S)
    results = await asyncio.gather(
        *(
            post_json(ctx.pool.session, e.url + "/abort_request", body, limits=limits, what="abort_request")
            for e in engines
        ),
        return_exceptions=True,
    )
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, UpstreamError):
            log.warning("%s did not take the abort_request: %s", engine.engine_id, result.message)
        elif isinstance(result, BaseException):
            raise result
    return Answer(200, engines=tuple(e.url for e in engines))


async def flush_caches(app: web.Application, query: Mapping[str, str]) -> Answer:
    """`GET|POST /flush_cache` (module docstring), with its query (`timeout`)."""
    ctx = app[CONTEXT]
    engines = [e for e in ctx.pool.engines.values() if e.info.family is EngineFamily.SGLANG]
    timeout_s = _flush_timeout_s(query)
    encoded = urlencode(list(query.items()))
    suffix = f"?{encoded}" if encoded else ""
    limits = aiohttp.ClientTimeout(total=ENGINE_CALL_S + timeout_s)
    statuses = await asyncio.gather(
        *(status_of(ctx.pool.session, e.url + "/flush_cache" + suffix, limits=limits) for e in engines)
    )
    failed = []
    for engine, status in zip(engines, statuses, strict=True):
        if status is not None and 200 <= status < 300:
            ctx.driver.handle(EngineCacheFlushed(engine_id=engine.engine_id))
        else:
            failed.append(f"{engine.engine_id} ({engine.url}): {status or 'no answer'}")
    urls = tuple(e.url for e in engines)
    if failed:
        return Answer(400, text="Flush cache failed on " + ", ".join(failed) + "\n", engines=urls)
    return Answer(200, text="Cache flushed.\n", engines=urls)


def _flush_timeout_s(query: Mapping[str, str]) -> float:
    """SGLang's `?timeout=` (seconds an engine waits to be idle before flushing); 0 when absent."""
    raw = query.get("timeout")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(
            "'timeout' must be a number of seconds", param="timeout", code="invalid_value"
        ) from None
    if not 0 <= value <= 3600:
        raise BadRequest("'timeout' must be between 0 and 3600", param="timeout", code="invalid_value")
    return value


async def abort_request(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    raw = await request.read()
    answer = await abort_requests(request.app, parse_body(raw, ctx.settings) if raw.strip() else {})
    return answer.response()


async def flush_cache(request: web.Request) -> web.Response:
    check_worker_admin(request, request.app[CONTEXT].settings)
    return (await flush_caches(request.app, request.query)).response()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/abort_request", guarded(abort_request))
    app.router.add_route("GET", "/flush_cache", guarded(flush_cache))
    app.router.add_route("POST", "/flush_cache", guarded(flush_cache))
