"""Worker (engine pool) management API: ours and the miles router's (`/add_worker`, `/list_workers`,
`/remove_worker`). Engines run prefill and decode both: a prefill or decode worker (`worker_type`, SGLang's
disaggregation) is refused by name rather than served as a regular one."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from rolloutgate.config import EngineSpec
from rolloutgate.engines.base import UpstreamError
from rolloutgate.errors import BadRequest, NotFound, UpstreamFailure
from rolloutgate.server.auth import check_worker_admin
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded
from rolloutgate.server.validate import parse_body

__all__ = ("add_routes", "refuse_disaggregated")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


async def _add(request: web.Request, spec_fields: dict[str, Any]) -> web.Response:
    ctx = request.app[CONTEXT]
    try:
        spec = EngineSpec(**spec_fields)
    except (ValidationError, TypeError) as exc:
        raise BadRequest(f"invalid worker: {exc}", code="invalid_worker") from None
    try:
        handle = await ctx.pool.add(spec)
    except UpstreamError as exc:
        raise UpstreamFailure(
            f"cannot reach worker {spec.url}: {exc.message}", code="worker_unreachable"
        ) from None
    return _json(ctx.pool.describe(handle), status=201)


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
    return _json({"workers": [ctx.pool.describe(e) for e in ctx.pool.engines.values()]})


async def delete_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    worker_id = request.match_info["worker_id"]
    handle = ctx.pool.engines.get(worker_id) or ctx.pool.by_url(worker_id)
    if handle is None:
        raise NotFound(f"no worker {worker_id!r}", code="worker_not_found")
    ctx.pool.remove(handle.engine_id)
    return _json({"removed": ctx.pool.describe(handle)})


async def miles_add_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    raw = await request.read()
    body = parse_body(raw, ctx.settings) if raw.strip() else {}
    url = request.query.get("url") or request.query.get("worker_url") or body.get("url")
    if not isinstance(url, str) or not url:
        raise BadRequest("'url' is required (query or JSON body)", param="url", code="invalid_worker")
    refuse_disaggregated(request.query.get("worker_type") or body.get("worker_type"))
    return await _add(request, {"url": url})


async def miles_remove_worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    url = request.query.get("url") or request.query.get("worker_url")
    if not url:
        raise BadRequest("query parameter 'url' is required", param="url", code="invalid_worker")
    handle = ctx.pool.by_url(url)
    if handle is None:
        raise NotFound(f"no worker at {url!r}", code="worker_not_found")
    ctx.pool.remove(handle.engine_id)
    return _json({"removed": ctx.pool.describe(handle)})


async def miles_list_workers(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_worker_admin(request, ctx.settings)
    return _json({"urls": [e.url for e in ctx.pool.engines.values()]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/workers", guarded(add_worker))
    app.router.add_get("/workers", guarded(list_workers_api))
    app.router.add_delete("/workers/{worker_id}", guarded(delete_worker))
    app.router.add_post("/add_worker", guarded(miles_add_worker))
    app.router.add_get("/list_workers", guarded(miles_list_workers))
    app.router.add_post("/remove_worker", guarded(miles_remove_worker))
