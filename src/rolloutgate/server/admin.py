"""The admin API: the weight-update gate (`/admin/pause`, `/admin/resume`, `/admin/state`) and
`/admin/update_weights`, which orchestrates a whole update through the gateway.

Theory of operation: the core owns the gate's semantics (nothing dispatched, nobody charged while closed; in
abort mode in-flight work is aborted and re-queued). This module only sequences the engine calls around the
core's events:

    update (all at once):  GateClosed(mode) -> [drain: wait for in-flight to finish] -> pause engines ->
                           forward the update to every engine -> continue engines -> GateOpened
    update (staggered):    for each engine in turn: EnginePaused(e) -> [drain: wait for e's in-flight] ->
                           pause e -> update e -> continue e -> EngineResumed(e); the others keep serving

All or none (`"on_failure"`, all at once only). The engines are the pool as the update begins. With `keep`
(the default) an engine whose update failed is reported and serves on (its old weights: `--version-policy
latest-only` keeps requests off it). With `exclude` it is taken out of the pool before generation continues
(EngineLeft: what it held is re-queued on the others, charge forgiven), so nothing is served on mixed weights;
the trainer registers it again once it holds the fleet's weights. With `rollback` the engines that did update
are given `rollback_body` (the previous weights, as the trainer names them) on the same path, and the failed
ones, and any whose roll back failed, are taken out: the pool serves the previous weights, uniformly. The
report says which engines were taken out and which rolled back.

Engine pause modes per family: SGLang `pause_generation` (abort, retract, in_place), vLLM `/pause`
(abort, wait, keep); a drain needs no engine call (the gateway simply stops dispatching), nor does `external`:
a trainer that pauses and continues the engines itself (miles) says so with `POST /admin/pause {"mode":
"external"}` before and `/admin/resume` after, and the gateway holds its queue and charges nobody meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from rolloutgate.core.events import (
    EngineCacheFlushed,
    EnginePaused,
    EngineResumed,
    GateClosed,
    GateOpened,
    PauseMode,
    WeightsUpdated,
)
from rolloutgate.engines.base import UpstreamError
from rolloutgate.errors import BadRequest
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_admin
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.guard import guarded
from rolloutgate.server.pool import EngineHandle
from rolloutgate.server.validate import parse_body

__all__ = ("add_routes", "gateway_state", "pause_gate", "resume_gate", "update_all_weights")

_UPDATE_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_ipc",
        "/update_weight_version",
        "/update_weights",  # vLLM (dev mode)
    }
)


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


def _mode(body: dict[str, Any], default: str = "drain") -> PauseMode:
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


@contextlib.contextmanager
def _maintenance(engines: list[EngineHandle]) -> Iterator[None]:
    """Health checks of these engines are not judged meanwhile: a paused SGLang engine fails its probe."""
    for engine in engines:
        engine.maintenance += 1
    try:
        yield
    finally:
        for engine in engines:
            engine.maintenance -= 1


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


async def _pause_engines(engines: list[EngineHandle], mode: PauseMode) -> dict[str, str | None]:
    """Pause the engines themselves where the mode needs it; returns per engine the error, if any."""
    if mode in _NO_ENGINE_CALLS:
        return {e.engine_id: None for e in engines}
    results = await asyncio.gather(*(e.client.pause(mode.value) for e in engines), return_exceptions=True)
    return {
        e.engine_id: (str(r) if isinstance(r, BaseException) else None)
        for e, r in zip(engines, results, strict=True)
    }


async def _resume_engines(engines: list[EngineHandle], mode: PauseMode) -> None:
    if mode in _NO_ENGINE_CALLS:
        return
    await asyncio.gather(*(e.client.resume() for e in engines), return_exceptions=True)


async def _wait_drained(ctx: GatewayContext, engine_ids: set[str], deadline_s: float) -> bool:
    """Wait (real seconds) until none of these engines has requests in flight."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while loop.time() < end:
        in_flight = ctx.driver.core.stats().in_flight
        if not any(in_flight.get(e, 0) for e in engine_ids):
            return True
        await asyncio.sleep(0.01)
    return False


def _urls(engines: list[EngineHandle]) -> tuple[str, ...]:
    return tuple(e.url for e in engines)


async def pause_gate(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/pause`: close the gate, pause the engines where the mode needs it."""
    ctx = app[CONTEXT]
    mode = _mode(body)
    gate = app[GATE]
    engines = list(ctx.pool.engines.values())
    if _gate_mode(ctx) is None:  # a second pause while closed changes nothing at the engines' health
        for engine in engines:
            engine.maintenance += 1
        gate.held = [e.engine_id for e in engines]
    ctx.driver.handle(GateClosed(mode=mode))
    errors = await _pause_engines(engines, mode)
    return Answer(200, {"status": "paused", "mode": mode.value, "engines": errors}, engines=_urls(engines))


async def resume_gate(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/resume`: continue the engines the gateway paused, open the gate."""
    ctx = app[CONTEXT]
    weights_updated = body.get("weights_updated", False)
    if not isinstance(weights_updated, bool):
        raise BadRequest("weights_updated must be true or false", param="weights_updated")
    gate = app[GATE]
    engines = list(ctx.pool.engines.values())
    await _resume_engines(engines, _gate_mode(ctx) or PauseMode.DRAIN)
    if weights_updated:  # the trainer updated the engines itself while the gate was closed (e.g. over NCCL)
        for engine_id in ctx.pool.engines:
            ctx.driver.handle(EngineCacheFlushed(engine_id=engine_id))
        ctx.driver.handle(WeightsUpdated())
    held, gate.held = gate.held, []
    for engine_id in held:
        if engine_id in ctx.pool.engines:
            ctx.pool.engines[engine_id].maintenance -= 1
    ctx.driver.handle(GateOpened())
    return Answer(200, {"status": "resumed"}, engines=_urls(engines))


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


async def _update_one(
    ctx: GatewayContext, engine: EngineHandle, path: str, body: dict[str, Any]
) -> dict[str, Any]:
    started = ctx.driver.clock.now()
    try:
        answer = await engine.client.update_weights(path, body)
        ok = bool(answer.get("success", True)) if isinstance(answer, dict) else True
        error = None if ok else str(answer.get("message"))
    except UpstreamError as exc:
        answer, ok, error = None, False, exc.message
    # Whatever the outcome, the engine's prefix cache cannot be counted on any more (new weights make it
    # stale, and SGLang flushes it): placement treats its sessions' next turns as cold prefills.
    ctx.driver.handle(EngineCacheFlushed(engine_id=engine.engine_id))
    with contextlib.suppress(UpstreamError):
        await ctx.pool.renew_info(engine)
    return {
        "engine": engine.engine_id,
        "url": engine.url,
        "ok": ok,
        "error": error,
        "seconds": round(ctx.driver.clock.now() - started, 4),
        "weight_version": engine.info.weight_version,
        "response": answer,
    }


async def update_all_weights(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/update_weights`. Body: {"path": "/update_weights_from_disk", "body": {...}, "mode":
    "in_place", "staggered": false, "drain_timeout": seconds}. Answers with per-engine results and timings."""
    ctx = app[CONTEXT]
    path = body.get("path", "/update_weights_from_disk")
    if not isinstance(path, str) or path not in _UPDATE_PATHS:
        raise BadRequest(f"'path' must be one of {sorted(_UPDATE_PATHS)}", param="path", code="invalid_path")
    payload = body.get("body", {})
    if not isinstance(payload, dict):
        raise BadRequest("'body' must be an object", param="body", code="invalid_type")
    mode = _mode(body, default="in_place")
    if mode is PauseMode.EXTERNAL:
        raise BadRequest(
            "mode 'external' means the trainer pauses and updates the engines itself: use /admin/pause and "
            "/admin/resume around its own update",
            param="mode",
            code="invalid_mode",
        )
    on_failure = body.get("on_failure", "keep")
    if on_failure not in _ON_FAILURE:
        raise BadRequest(
            f"'on_failure' must be one of {list(_ON_FAILURE)}", param="on_failure", code="invalid_value"
        )
    rollback_body = body.get("rollback_body")
    if on_failure == "rollback" and not isinstance(rollback_body, dict):
        raise BadRequest(
            "'on_failure': 'rollback' needs 'rollback_body': the update call that puts the previous weights back",
            param="rollback_body",
            code="invalid_value",
        )
    if on_failure != "keep" and body.get("staggered"):
        raise BadRequest(
            "'on_failure' other than keep needs an all-at-once update (a staggered one serves the new weights "
            "on some engines while the others are updated)",
            param="on_failure",
            code="invalid_value",
        )
    drain_timeout = body.get("drain_timeout", 600.0)
    if (
        isinstance(drain_timeout, bool)
        or not isinstance(drain_timeout, int | float)
        or not 0 <= drain_timeout < 1e9
    ):
        raise BadRequest(
            "'drain_timeout' must be a number of seconds >= 0", param="drain_timeout", code="invalid_value"
        )
    engines = list(ctx.pool.engines.values())
    started = ctx.driver.clock.now()
    gate = app[GATE]
    settled: dict[str, Any] = {"excluded": [], "rolled_back": []}
    if body.get("staggered"):
        results = []
        for engine in engines:
            results.append(await _update_staggered(ctx, engine, path, payload, mode, drain_timeout))
        _count_update(ctx, results)  # once the whole pool serves the new weights
    else:
        ctx.driver.handle(GateClosed(mode=mode))
        try:
            with _maintenance(engines):
                if mode is PauseMode.DRAIN:
                    await _wait_drained(
                        ctx, {e.engine_id for e in engines}, ctx.driver.clock.real_seconds(drain_timeout)
                    )
                await _pause_engines(engines, mode)
                results = list(await asyncio.gather(*(_update_one(ctx, e, path, payload) for e in engines)))
                settled = await _settle_failures(ctx, engines, results, on_failure, path, rollback_body)
                await _resume_engines([e for e in engines if e.engine_id in ctx.pool.engines], mode)
                if not settled.get("rolled_back"):
                    _count_update(ctx, results)
        finally:
            ctx.driver.handle(GateOpened())
    report = {
        "ok": all(r["ok"] for r in results),
        "mode": mode.value,
        "staggered": bool(body.get("staggered")),
        "seconds": round(ctx.driver.clock.now() - started, 4),
        "engines": results,
        "on_failure": on_failure,
        **settled,
    }
    gate.last_update = report
    return Answer(200 if report["ok"] else 502, report, engines=_urls(engines))


_ON_FAILURE = ("keep", "exclude", "rollback")


async def _settle_failures(
    ctx: GatewayContext,
    engines: list[EngineHandle],
    results: list[dict[str, Any]],
    on_failure: str,
    path: str,
    rollback_body: dict[str, Any] | None,
) -> dict[str, Any]:
    """All or none (module docstring): the engines taken out, and those rolled back, for the report."""
    failed = [e for e, r in zip(engines, results, strict=True) if not r["ok"]]
    if not failed or on_failure == "keep":
        return {"excluded": [], "rolled_back": []}
    rolled_back: list[str] = []
    if on_failure == "rollback" and rollback_body is not None:
        updated = [e for e in engines if e not in failed]
        undone = await asyncio.gather(*(_update_one(ctx, e, path, rollback_body) for e in updated))
        rolled_back = [r["engine"] for r in undone if r["ok"]]
        failed += [e for e, r in zip(updated, undone, strict=True) if not r["ok"]]
    for engine in failed:  # off new and mixed weights: what it held goes to the others (EngineLeft)
        ctx.pool.remove(engine.engine_id)
    return {"excluded": [e.engine_id for e in failed], "rolled_back": rolled_back}


def _count_update(ctx: GatewayContext, results: list[dict[str, Any]]) -> None:
    """An update that reached some engine is one more weight version for the core (core/weights.py)."""
    versions = [r["weight_version"] for r in results if r["ok"]]
    if versions:
        ctx.driver.handle(WeightsUpdated(engine_version=versions[0]))


async def _update_staggered(
    ctx: GatewayContext,
    engine: EngineHandle,
    path: str,
    payload: dict[str, Any],
    mode: PauseMode,
    drain_timeout: float,
) -> dict[str, Any]:
    ctx.driver.handle(EnginePaused(engine_id=engine.engine_id))
    try:
        with _maintenance([engine]):
            if mode is PauseMode.DRAIN:
                await _wait_drained(ctx, {engine.engine_id}, ctx.driver.clock.real_seconds(drain_timeout))
            await _pause_engines([engine], mode)
            result = await _update_one(ctx, engine, path, payload)
            await _resume_engines([engine], mode)
            return result
    finally:
        ctx.driver.handle(EngineResumed(engine_id=engine.engine_id))


def _admin_call(operation: Callable[[web.Application, dict[str, Any]], Awaitable[Answer]]) -> Handler:
    """The HTTP handler of an admin operation: the caller's rights, the body, the answer."""

    async def handler(request: web.Request) -> web.Response:
        ctx = request.app[CONTEXT]
        check_admin(request, ctx.settings)
        answer = await operation(request.app, await _body(request, ctx))
        return answer.response()

    return guarded(handler)


def add_routes(app: web.Application) -> None:
    app[GATE] = GateRecord()
    app.router.add_post("/admin/pause", _admin_call(pause_gate))
    app.router.add_post("/admin/resume", _admin_call(resume_gate))
    app.router.add_get("/admin/state", guarded(state))
    app.router.add_post("/admin/update_weights", _admin_call(update_all_weights))
