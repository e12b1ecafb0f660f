"""Engine registration on any replica, for the whole fleet: the worker API answered through the controller.

Theory of operation: in a fleet an engine is registered once, with the controller, which gives it one owner
(fleet/assignment.py); the owner's view then adds it to its pool. So on every replica the worker routes of
server/workers.py, in both dialects, are answered here instead:

- `POST /workers {"url", ...}`, `POST /add_worker?url=`: the controller registers the engine and waits for its
  owner to probe it; 201 with the owner's description (`id` is the fleet id, `replica_engine_id` the owner's
  own), or 502 `worker_unreachable` (the engine is dropped again, as one gateway does);
- `GET /workers`, `GET /list_workers`: every engine of the fleet, with its owner;
- `DELETE /workers/{id}` (fleet id or URL), `POST /remove_worker?url=`: unregistered for the fleet.

The same rights as one gateway (`check_worker_admin`: the admin token, or a trusted network); the caller is
judged here, where its own address is seen. A replica's own shard is in its `/admin/state`.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from rolloutgate.errors import BadRequest, NotFound, Unavailable, UpstreamFailure
from rolloutgate.fleet.assignment import EngineEntry, FleetView, engine_fleet_id
from rolloutgate.fleet.links import ControllerLink, ControllerUnreachable, EngineChange
from rolloutgate.server.auth import check_worker_admin
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.validate import parse_body
from rolloutgate.server.workers import refuse_disaggregated

__all__ = ("describe_engine", "serve_registration")

DEFAULT_JOIN_WAIT_S = 30.0  # how long registration waits for the owner to probe the engine


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


def describe_engine(view: FleetView, url: str) -> dict[str, Any]:
    entry = view.engines[url]
    owner = view.owners.get(url)
    return {
        "id": engine_fleet_id(url),
        "url": url,
        "family": entry.family,
        "capacity": entry.capacity,
        "owner": owner,
        "owner_url": view.url_of(owner) if owner else None,
    }


async def _entry_of(request: web.Request) -> EngineEntry:
    settings = request.app[CONTEXT].settings
    raw = await request.read()
    body = parse_body(raw, settings) if raw.strip() else {}
    url = request.query.get("url") or request.query.get("worker_url") or body.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadRequest("'url' (http:// or https://) is required", param="url", code="invalid_worker")
    refuse_disaggregated(request.query.get("worker_type") or body.get("worker_type"))
    family = body.get("family", "auto")
    capacity = body.get("capacity")
    if family not in ("auto", "sglang", "vllm", "openai") or not (
        capacity is None or (isinstance(capacity, int) and capacity >= 1)
    ):
        raise BadRequest("invalid 'family' or 'capacity'", code="invalid_worker")
    return EngineEntry(url=url.rstrip("/"), family=family, capacity=capacity)


def _added(change: EngineChange) -> web.Response:
    if not change.ok:
        raise UpstreamFailure(
            f"cannot reach worker {change.url}: {change.error}", code=change.code or "worker_unreachable"
        )
    described = describe_engine(change.view, change.url) if change.url in change.view.engines else {}
    worker = {**change.worker, **described, "replica_engine_id": change.worker.get("id")}
    if change.error:
        worker["note"] = change.error
    return _json(worker, status=201)


def _removed(change: EngineChange) -> web.Response:
    if not change.ok:
        raise NotFound(change.error or f"no worker {change.url!r}", code=change.code or "worker_not_found")
    return _json({"removed": {"id": engine_fleet_id(change.url), "url": change.url, "owner": change.owner}})


async def serve_registration(
    request: web.Request, controller: ControllerLink, *, join_wait_s: float = DEFAULT_JOIN_WAIT_S
) -> web.StreamResponse:
    """Answer one worker route (module docstring). Raises GatewayError (the caller's guard answers it)."""
    check_worker_admin(request, request.app[CONTEXT].settings)
    method, path = request.method, request.path
    try:
        if method == "GET":
            view = await controller.view()
            if path == "/list_workers":
                return _json({"urls": list(view.engines)})
            return _json({"workers": [describe_engine(view, url) for url in view.engines]})
        if method == "POST" and path in ("/workers", "/add_worker"):
            return _added(await controller.add_engine(await _entry_of(request), join_wait_s))
        if method == "DELETE":
            return _removed(await controller.remove_engine(path.removeprefix("/workers/")))
        url = request.query.get("url") or request.query.get("worker_url")
        if not url:
            raise BadRequest("query parameter 'url' is required", param="url", code="invalid_worker")
        return _removed(await controller.remove_engine(url))
    except ControllerUnreachable as exc:
        raise Unavailable(f"the fleet's controller did not answer: {exc}", retry_after_s=1) from None
