"""The admin API's gate: `/admin/pause`, `/admin/resume`, `/admin/state`, and the pieces a weight update
through the gateway (server/weight_update.py) sequences.

Theory of operation: the core owns the gate's semantics (nothing dispatched, nobody charged while closed; in
abort mode in-flight work is aborted and re-queued). This module only sequences the engine calls around the
core's events: a pause closes the gate (GateClosed(mode)) and pauses the engines where the mode needs it, a
resume continues them and opens it (GateOpened).

Engine pause modes per family: SGLang `pause_generation` (abort, retract, in_place), vLLM `/pause`
(abort, wait, keep); a drain needs no engine call (the gateway simply stops dispatching), nor does `external`:
a trainer that pauses and continues the engines itself (miles) says so with `POST /admin/pause {"mode":
"external"}` before and `/admin/resume` after, and the gateway holds its queue and charges nobody meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from rolloutgate.core.events import (
    EngineCacheFlushed,
    GateClosed,
    GateOpened,
    PauseMode,
    WeightsUpdated,
)
from rolloutgate.errors import BadRequest
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_admin
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.engine_handle import EngineHandle
from rolloutgate.server.guard import guarded
from rolloutgate.server.validate import parse_body

__all__ = (
    "GATE",
    "GateRecord",
    "add_routes",
    "admin_call",
    "engine_urls",
    "gateway_state",
    "pause_engines",
    "pause_gate",
    "pause_mode",
    "resume_engines",
    "resume_gate",
    "wait_drained",
)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


def pause_mode(body: dict[str, Any], default: str = "drain") -> PauseMode:
    raw = body.get("mode", default)
    try:
        return PauseMode(raw)
    except ValueError:
        raise BadRequest(
            f"'mode' must be one of {[m.value for m in PauseMode]}", param="mode", code="invalid_mode"
        ) from None


async def _body(request: web.Request, ctx: GatewayContext) -> dict[str, Any]:
    raw = await request.read()
    return parse_body(raw, ctx.settings) if raw.strip() else {}


@dataclass(slots=True)
class GateRecord:
    """What the edge keeps of the gate beside the core's state (open or the mode it is closed in: the core's,
    `GatewayStats.gate`, never copied here)."""

    held: list[str] = field(default_factory=list)  # engines whose health judging the closure suspended
    last_update: dict[str, Any] | None = None  # the last /admin/update_weights report


GATE: web.AppKey[GateRecord] = web.AppKey("rolloutgate_gate", GateRecord)


def _gate_mode(ctx: GatewayContext) -> PauseMode | None:
    """The mode the core's gate is closed in; None while open."""
    state = ctx.driver.core.stats().gate
    return None if state == "open" else PauseMode(state)


# modes in which the gateway sends the engines nothing: it drains them itself, or the trainer pauses them
_NO_ENGINE_CALLS = frozenset({PauseMode.DRAIN, PauseMode.EXTERNAL})


async def pause_engines(engines: list[EngineHandle], mode: PauseMode) -> dict[str, str | None]:
    """Pause the engines themselves where the mode needs it; returns per engine the error, if any."""
    if mode in _NO_ENGINE_CALLS:
        return {e.engine_id: None for e in engines}
    results = await asyncio.gather(*(e.client.pause(mode.value) for e in engines), return_exceptions=True)
    return {
        e.engine_id: (str(r) if isinstance(r, BaseException) else None)
        for e, r in zip(engines, results, strict=True)
    }


async def resume_engines(engines: list[EngineHandle], mode: PauseMode) -> None:
    if mode in _NO_ENGINE_CALLS:
        return
    await asyncio.gather(*(e.client.resume() for e in engines), return_exceptions=True)


async def wait_drained(ctx: GatewayContext, engine_ids: set[str], deadline_s: float) -> bool:
    """Wait (real seconds) until none of these engines has requests in flight."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        in_flight = ctx.driver.core.stats().in_flight
        if not any(in_flight.get(e, 0) for e in engine_ids):
            return True
        await asyncio.sleep(0.01)
    return False


def engine_urls(engines: list[EngineHandle]) -> tuple[str, ...]:
    return tuple(e.url for e in engines)


async def pause_gate(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/pause`: close the gate, pause the engines where the mode needs it."""
    ctx = app[CONTEXT]
    mode = pause_mode(body)
    gate = app[GATE]
    engines = list(ctx.pool.engines.values())
    if _gate_mode(ctx) is None:  # a second pause while closed changes nothing at the engines' health
        for engine in engines:
            engine.maintenance += 1
        gate.held = [e.engine_id for e in engines]
    ctx.driver.handle(GateClosed(mode=mode))
    errors = await pause_engines(engines, mode)
    return Answer(
        200, {"status": "paused", "mode": mode.value, "engines": errors}, engines=engine_urls(engines)
    )


async def resume_gate(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/resume`: continue the engines the gateway paused, open the gate."""
    ctx = app[CONTEXT]
    weights_updated = body.get("weights_updated", False)
    if not isinstance(weights_updated, bool):
        raise BadRequest("weights_updated must be true or false", param="weights_updated")
    gate = app[GATE]
    engines = list(ctx.pool.engines.values())
    await resume_engines(engines, _gate_mode(ctx) or PauseMode.DRAIN)
    if weights_updated:  # the trainer updated the engines itself while the gate was closed (e.g. over NCCL)
        for engine_id in ctx.pool.engines:
            ctx.driver.handle(EngineCacheFlushed(engine_id=engine_id))
        ctx.driver.handle(WeightsUpdated())
    held, gate.held = gate.held, []
    for engine_id in held:
        if engine_id in ctx.pool.engines:
            ctx.pool.engines[engine_id].maintenance -= 1
    ctx.driver.handle(GateOpened())
    return Answer(200, {"status": "resumed"}, engines=engine_urls(engines))


async def state(request: web.Request) -> web.Response:
    check_admin(request, request.app[CONTEXT].settings)
    return _json(gateway_state(request.app))


def gateway_state(app: web.Application) -> dict[str, Any]:
    """`GET /admin/state`: the gate, the queue, the engines, and the sections parts mounted."""
    ctx = app[CONTEXT]
    stats = ctx.driver.core.stats()
    now = ctx.driver.clock.now()
    gate = app[GATE]
    in_core = {e.engine_id: e for e in stats.engines}
    is_gate_open = stats.gate == "open"
    return {
        "gate": {
            "open": stats.gate == "open",
            "mode": None if stats.gate == "open" else stats.gate,
            "closed_for_s": None if stats.gate == "open" else round(now - stats.gate_closed_at, 3),
            "last_update": gate.last_update,
        },
        "queue_depth": stats.queue_depth,
        "in_flight": dict(stats.in_flight),
        "weights": {  # the gateway's count of updates, the engines' label beside it (core/weights.py)
            "version": stats.weight_version,
            "engine_version": stats.engine_weight_version,
            "stale_requeued": stats.stale_requeued,
            "stale_partial": stats.stale_partial,
        },
        "engines": [
            ctx.pool.describe_live(e, in_core.get(e.engine_id), is_gate_open=is_gate_open, now=now)
            for e in ctx.pool.engines.values()
        ],
        # registered, not joined yet: probed until they answer (server/pool.py `register`)
        "pending_engines": [p.describe() for p in ctx.pool.pending.values()],
        **{name: read() for name, read in ctx.state_sections.items()},  # parts mounted later (the fleet)
    }


def admin_call(operation: Callable[[web.Application, dict[str, Any]], Awaitable[Answer]]) -> Handler:
    """The HTTP handler of an admin operation: the caller's rights, the body, the answer."""

    async def handler(request: web.Request) -> web.Response:
        ctx = request.app[CONTEXT]
        check_admin(request, ctx.settings)
        answer = await operation(request.app, await _body(request, ctx))
        return answer.response()

    return guarded(handler)


def add_routes(app: web.Application) -> None:
    app[GATE] = GateRecord()
    app.router.add_post("/admin/pause", admin_call(pause_gate))
    app.router.add_post("/admin/resume", admin_call(resume_gate))
    app.router.add_get("/admin/state", guarded(state))
