"""The cluster's own admin port: faults and state for every engine, reachable even when an engine's port
is down (a crashed engine cannot serve its own `/sim/faults`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiohttp import web

from rolloutsim.http_common import apply_fault_body, fault_list, json_response, read_json
from rolloutsim.params import BadRequest

if TYPE_CHECKING:
    from rolloutsim.engine import SimEngine

__all__ = ("build_admin_app",)


def _select(engines: Sequence[SimEngine], selector: object) -> list[SimEngine]:
    """`all` (or absent) or an engine index."""
    if selector is None or selector == "all":
        return list(engines)
    try:
        index = int(str(selector))
    except ValueError as exc:
        raise BadRequest(f"engine must be an index or 'all', got {selector!r}") from exc
    if not 0 <= index < len(engines):
        raise BadRequest(f"no engine {index}; there are {len(engines)}")
    return [engines[index]]


def build_admin_app(engines: Sequence[SimEngine]) -> web.Application:
    async def get_state(request: web.Request) -> web.Response:
        include = request.query.get("requests", "1") not in ("0", "false")
        try:
            chosen = _select(engines, request.query.get("engine"))
        except BadRequest as exc:
            return json_response({"error": {"message": exc.message}}, status=400)
        return json_response({"engines": [e.state(include_requests=include) for e in chosen]})

    async def post_faults(request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            listed = await apply_fault_body(_select(engines, body.get("engine")), body)
        except BadRequest as exc:
            return json_response({"error": {"message": exc.message}}, status=400)
        return json_response({"faults": listed})

    async def get_faults(_request: web.Request) -> web.Response:
        return json_response({"faults": fault_list(engines)})

    async def delete_faults(request: web.Request) -> web.Response:
        try:
            chosen = _select(engines, request.query.get("engine"))
        except BadRequest as exc:
            return json_response({"error": {"message": exc.message}}, status=400)
        for engine in chosen:
            engine.clear_faults()
        return json_response({"faults": fault_list(engines)})

    app = web.Application()
    app.router.add_get("/sim/state", get_state)
    app.router.add_post("/sim/faults", post_faults)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_delete("/sim/faults", delete_faults)
    return app
