"""Worker (engine pool) management API: ours and the miles router's (`/add_worker`, `/list_workers`,
`/remove_worker`). Engines run prefill and decode both: a prefill or decode worker (`worker_type`, SGLang's
disaggregation) is refused by name rather than served as a regular one.

A worker is registered as miles' router takes one: at once. One whose probe succeeds joins (201, its
description); one not listening yet, or not answering as an engine, is kept pending (202, state `pending`,
with what its last probe met) and joins when it answers (server/pool.py `register`). Both are listed, and
either can be removed. Registering a URL again answers what is there (200). The miles dialect's answers carry
`"status": "success"` as miles' router's do."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from rolloutgate.config import EngineSpec
from rolloutgate.errors import BadRequest, NotFound
from rolloutgate.server.auth import check_worker_admin
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.engine_handle import PendingEngine
from rolloutgate.server.guard import guarded
from rolloutgate.server.pool import EnginePool
from rolloutgate.server.validate import parse_body

__all__ = ("add_routes", "refuse_disaggregated")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


async def _add(
    request: web.Request, spec_fields: dict[str, Any], extra: dict[str, Any] | None = None
) -> web.Response:
    ctx = request.app[CONTEXT]
    try:
        spec = EngineSpec(**spec_fields)
    except (ValidationError, TypeError) as exc:
        raise BadRequest(f"invalid worker: {exc}", code="invalid_worker") from None
    pool = ctx.pool
    known = pool.by_url(spec.url) is not None or spec.url in pool.pending
    registered = await pool.register(spec)
    if isinstance(registered, PendingEngine):
        described, status = registered.describe(), 202
    else:
        described, status = pool.describe(registered), 201
    return _json({**(extra or {}), **described}, status=200 if known else status)


def _described(ctx: GatewayContext) -> list[dict[str, object]]:
    """Every registered worker: those that joined, then those pending; each with the gateway's requests on it
    (miles' router lists these counts as `worker_request_counts`)."""
    pool, in_flight = ctx.pool, ctx.driver.core.stats().in_flight
    return [
        {**pool.describe(e), "in_flight": in_flight.get(e.engine_id, 0)} for e in pool.engines.values()
    ] + [{**p.describe(), "in_flight": 0} for p in pool.pending.values()]


def _remove(pool: EnginePool, key: str, *, by_id: bool = True) -> dict[str, object] | None:
    """Remove the worker with this URL (or id, when `by_id`), joined or pending; its description, None if
    there is none."""
    handle = (pool.engines.get(key) if by_id else None) or pool.by_url(key)
    if handle is not None:
        described = pool.describe(handle)
        pool.remove(handle.engine_id)
        return described
    pending = pool.find_pending(key)
    if pending is None or (not by_id and pending.url != key.rstrip("/")):
        return None
    pool.drop_pending(pending)
    return pending.describe()


async def add_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    body = parse_body(await request.read(), ctx.settings)
    if not isinstance(body.get("url"), str):
        raise BadRequest("'url' is required", param="url", code="invalid_worker")
    refuse_disaggregated(body.get("worker_type"))
    return await _add(request, {k: v for k, v in body.items() if k in ("url", "family", "capacity")})


def refuse_disaggregated(worker_type: object) -> None:
    """400 for a prefill or decode worker (the miles router's `worker_type`): only regular engines join."""
    if worker_type not in (None, "regular"):
        raise BadRequest(
            f"worker_type {worker_type!r} is not supported: rolloutgate serves regular engines (prefill and "
            "decode in one), not prefill-decode disaggregation",
            param="worker_type",
            code="unsupported_worker_type",
        )


async def list_workers_api(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    return _json({"workers": _described(ctx)})


async def delete_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    worker_id = request.match_info["worker_id"]
    removed = _remove(ctx.pool, worker_id)
    if removed is None:
        raise NotFound(f"no worker {worker_id!r}", code="worker_not_found")
    return _json({"removed": removed})


async def miles_add_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    raw = await request.read()
    body = parse_body(raw, ctx.settings) if raw.strip() else {}
    url = request.query.get("url") or request.query.get("worker_url") or body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required (query or JSON body)", param="url", code="invalid_worker")
    refuse_disaggregated(request.query.get("worker_type") or body.get("worker_type"))
    return await _add(request, {"url": url}, {"status": "success"})


async def miles_remove_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    url = request.query.get("url") or request.query.get("worker_url")
    if not url:
        raise BadRequest("query parameter 'url' is required", param="url", code="invalid_worker")
    removed = _remove(ctx.pool, url, by_id=False)
    if removed is None:
        raise NotFound(f"no worker at {url!r}", code="worker_not_found")
    return _json({"status": "success", "removed": removed})


async def miles_list_workers(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    return _json({"urls": [worker["url"] for worker in _described(ctx)]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/workers", guarded(add_worker))
    app.router.add_get("/workers", guarded(list_workers_api))
    app.router.add_delete("/workers/{worker_id}", guarded(delete_worker))
    app.router.add_post("/add_worker", guarded(miles_add_worker))
    app.router.add_get("/list_workers", guarded(miles_list_workers))
    app.router.add_post("/remove_worker", guarded(miles_remove_worker))
