"""`/admin/update_weights`: a whole weight update through the gateway, all at once or staggered, all or none.

Theory of operation: the gate (server/admin.py) and the core do the holding; this module sequences the engine
calls around the core's events:

    update (all at once):  GateClosed(mode) -> [drain: wait for in-flight to finish] -> pause engines ->
                           forward the update to every engine -> settle failures -> continue engines ->
                           GateOpened
    update (staggered):    for each engine in turn: EnginePaused(e) -> [drain: wait for e's in-flight] ->
                           pause e -> update e -> continue e -> EngineResumed(e); the others keep serving

All or none (`"on_failure"`, all at once only). The engines are the pool as the update begins. With `exclude`
(the default) an engine whose update failed is taken out of the pool before generation continues (EngineLeft:
what it held is re-queued on the others, charge forgiven), so nothing is served on mixed weights, not even the
rest of a call the update found running there (the replay in docs/rl.md served 7,288 tokens on old weights
that way under `keep`); the trainer registers it again once it holds the fleet's weights. With `keep` (a
staggered update's only mode: it serves mixed weights by design) it is reported and serves on with its old
weights (`--version-policy latest-only` keeps new requests off it; what it held goes on). With `rollback` the engines that did update
are given `rollback_body` (the previous weights, as the trainer names them) on the same path, and the failed
ones, and any whose roll back failed, are taken out: the pool serves the previous weights, uniformly. The
report says which engines were taken out and which rolled back.

The all-at-once update is two steps, `begin_update` (up to the updates: the gate stays closed, the engines
paused) and `finish_update` (settle, continue, open), so that a fleet's controller can learn every replica's
outcome before any engine generates again (fleet/operations.py): a replica whose own engines all took the
update still rolls them back when an engine of another replica failed (`failed_elsewhere`). One gateway runs
both steps in one call. A replica that began and is never told to finish finishes by itself after
`FINISH_WAIT_S`, as if an engine elsewhere had failed: an update nobody confirmed is not served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

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
from rolloutgate.server.admin import (
    GATE,
    admin_call,
    engine_urls,
    pause_engines,
    pause_mode,
    resume_engines,
    wait_drained,
)
from rolloutgate.server.answer import Answer
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.engine_handle import EngineHandle

__all__ = ("add_routes", "begin_fleet_part", "finish_fleet_part", "update_all_weights")

log = logging.getLogger("rolloutgate.weights")

UPDATE_PATHS = frozenset(
    {
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_ipc",
        "/update_weight_version",
        "/update_weights",  # vLLM (dev mode)
    }
)
ON_FAILURE = ("keep", "exclude", "rollback")
FINISH_WAIT_S = 120.0  # real seconds a begun update waits for its controller's verdict (module docstring)


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """What `/admin/update_weights` asked, checked."""

    path: str
    payload: dict[str, Any]
    mode: PauseMode
    on_failure: str
    rollback_body: dict[str, Any] | None
    staggered: bool
    drain_timeout: float


def _plan(body: dict[str, Any]) -> UpdatePlan:
    """Body: {"path": "/update_weights_from_disk", "body": {...}, "mode": "in_place", "staggered": false,
    "drain_timeout": seconds, "on_failure": "exclude", "rollback_body": {...}}; a BadRequest for what is wrong."""
    path = body.get("path", "/update_weights_from_disk")
    if not isinstance(path, str) or path not in UPDATE_PATHS:
        raise BadRequest(f"'path' must be one of {sorted(UPDATE_PATHS)}", param="path", code="invalid_path")
    payload = body.get("body", {})
    if not isinstance(payload, dict):
        raise BadRequest("'body' must be an object", param="body", code="invalid_type")
    mode = pause_mode(body, default="in_place")
    if mode is PauseMode.EXTERNAL:
        raise BadRequest(
            "mode 'external' means the trainer pauses and updates the engines itself: use /admin/pause and "
            "/admin/resume around its own update",
            param="mode",
            code="invalid_mode",
        )
    staggered = bool(body.get("staggered"))
    # all at once: a failed engine is taken out (no mixed weights); staggered updates serve mixed weights anyway
    on_failure = body.get("on_failure", "keep" if staggered else "exclude")
    if on_failure not in ON_FAILURE:
        raise BadRequest(
            f"'on_failure' must be one of {list(ON_FAILURE)}", param="on_failure", code="invalid_value"
        )
    rollback_body = body.get("rollback_body")
    if on_failure == "rollback" and not isinstance(rollback_body, dict):
        raise BadRequest(
            "'on_failure': 'rollback' needs 'rollback_body': the update call that puts the previous weights back",
            param="rollback_body",
            code="invalid_value",
        )
    if on_failure != "keep" and staggered:
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
    return UpdatePlan(
        path=path,
        payload=payload,
        mode=mode,
        on_failure=on_failure,
        rollback_body=rollback_body if isinstance(rollback_body, dict) else None,
        staggered=staggered,
        drain_timeout=float(drain_timeout),
    )


@dataclass(eq=False)
class PendingUpdate:
    """An all-at-once update between its two steps: the gate closed, the engines paused and updated."""

    plan: UpdatePlan
    engines: list[EngineHandle]
    started: float
    results: list[dict[str, Any]] = field(default_factory=list)
    expiry: asyncio.Task[None] | None = None  # a fleet's: finishes it unless the controller does first

    @property
    def failed(self) -> list[str]:
        return [r["engine"] for r in self.results if not r["ok"]]


@dataclass(eq=False)
class UpdateSlot:
    """The update a replica of a fleet has begun and not finished, if any."""

    pending: PendingUpdate | None = None


UPDATE_SLOT: web.AppKey[UpdateSlot] = web.AppKey("rolloutgate_update_slot", UpdateSlot)


async def update_all_weights(app: web.Application, body: dict[str, Any]) -> Answer:
    """`POST /admin/update_weights` on one gateway: the whole update (module docstring), per-engine results and
    timings in the answer; 502 when an engine did not take it."""
    plan = _plan(body)
    ctx = app[CONTEXT]
    if not plan.staggered:
        return await finish_update(app, await begin_update(app, plan))
    started = ctx.driver.clock.now()
    engines = list(ctx.pool.engines.values())
    results = [await _update_staggered(ctx, engine, plan) for engine in engines]
    _count_update(ctx, results)  # once the whole pool serves the new weights
    return _report(app, plan, engines, results, started, {"excluded": [], "rolled_back": []})


async def begin_update(app: web.Application, plan: UpdatePlan) -> PendingUpdate:
    """Close the gate, drain where the mode drains, pause the engines and update them; they stay paused."""
    ctx = app[CONTEXT]
    engines = list(ctx.pool.engines.values())
    pending = PendingUpdate(plan, engines, ctx.driver.clock.now())
    ctx.driver.handle(GateClosed(mode=plan.mode))
    for engine in engines:  # a paused SGLang engine fails its health probe: not judged meanwhile
        engine.maintenance += 1
    try:
        if plan.mode is PauseMode.DRAIN:
            drain_s = ctx.driver.clock.real_seconds(plan.drain_timeout)
            await wait_drained(ctx, {e.engine_id for e in engines}, drain_s)
        await pause_engines(engines, plan.mode)
        pending.results = list(
            await asyncio.gather(*(_update_one(ctx, e, plan.path, plan.payload) for e in engines))
        )
    except BaseException:
        _reopen(ctx, pending)
        raise
    return pending


async def finish_update(
    app: web.Application,
    pending: PendingUpdate,
    *,
    failed_elsewhere: bool = False,
    updated_elsewhere: bool = False,
) -> Answer:
    """Settle the failures (all or none), continue the engines, open the gate; the update's report."""
    ctx = app[CONTEXT]
    plan = pending.plan
    try:
        settled = await _settle_failures(ctx, pending, failed_elsewhere, updated_elsewhere)
        await resume_engines([e for e in pending.engines if e.engine_id in ctx.pool.engines], plan.mode)
        if not settled["rolled_back"]:
            _count_update(ctx, pending.results)
    finally:
        _reopen(ctx, pending)
    return _report(app, plan, pending.engines, pending.results, pending.started, settled)


def _reopen(ctx: GatewayContext, pending: PendingUpdate) -> None:
    for engine in pending.engines:
        engine.maintenance -= 1
    ctx.driver.handle(GateOpened())


def _report(
    app: web.Application,
    plan: UpdatePlan,
    engines: list[EngineHandle],
    results: list[dict[str, Any]],
    started: float,
    settled: dict[str, list[str]],
) -> Answer:
    ctx = app[CONTEXT]
    report = {
        "ok": all(r["ok"] for r in results),
        "mode": plan.mode.value,
        "staggered": plan.staggered,
        "seconds": round(ctx.driver.clock.now() - started, 4),
        "engines": results,
        "on_failure": plan.on_failure,
        **settled,
    }
    app[GATE].last_update = report
    return Answer(200 if report["ok"] else 502, report, engines=engine_urls(engines))


async def _settle_failures(
    ctx: GatewayContext, pending: PendingUpdate, failed_elsewhere: bool, updated_elsewhere: bool
) -> dict[str, list[str]]:
    """All or none (module docstring): the engines taken out, and those rolled back, for the report. An update
    no engine took (a body every engine refused) left them all on the same weights: nothing to settle."""
    plan, engines = pending.plan, pending.engines
    failed = [e for e, r in zip(engines, pending.results, strict=True) if not r["ok"]]
    took_it = len(failed) < len(engines) or updated_elsewhere
    if plan.on_failure == "keep" or not (failed or failed_elsewhere) or not took_it:
        return {"excluded": [], "rolled_back": []}
    rolled_back: list[str] = []
    if plan.on_failure == "rollback" and plan.rollback_body is not None:
        updated = [e for e in engines if e not in failed]
        undone = await asyncio.gather(*(_update_one(ctx, e, plan.path, plan.rollback_body) for e in updated))
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


async def _update_staggered(ctx: GatewayContext, engine: EngineHandle, plan: UpdatePlan) -> dict[str, Any]:
    ctx.driver.handle(EnginePaused(engine_id=engine.engine_id))
    engine.maintenance += 1
    try:
        if plan.mode is PauseMode.DRAIN:
            drain_s = ctx.driver.clock.real_seconds(plan.drain_timeout)
            await wait_drained(ctx, {engine.engine_id}, drain_s)
        await pause_engines([engine], plan.mode)
        result = await _update_one(ctx, engine, plan.path, plan.payload)
        await resume_engines([engine], plan.mode)
        return result
    finally:
        engine.maintenance -= 1
        ctx.driver.handle(EngineResumed(engine_id=engine.engine_id))


# --- a fleet's two steps (fleet/operations.py) -------------------------------------------------------------


async def begin_fleet_part(app: web.Application, body: dict[str, Any]) -> Answer:
    """This replica's first step of a fleet's all-at-once update: its engines paused and updated, the gate
    closed until `finish_fleet_part` (or `FINISH_WAIT_S`). Answers which of its engines failed."""
    plan = _plan(body)
    if plan.staggered:
        raise BadRequest("a fleet updates in two steps all at once only", param="staggered")
    slot = app[UPDATE_SLOT]
    if slot.pending is not None:
        raise BadRequest("a weight update is under way here", status=409, code="update_in_progress")
    pending = slot.pending = await begin_update(app, plan)
    pending.expiry = asyncio.create_task(_finish_unless_told(app, pending))
    return Answer(200, {"begun": True, "failed": pending.failed}, engines=engine_urls(pending.engines))


async def finish_fleet_part(app: web.Application, body: dict[str, Any]) -> Answer:
    """This replica's second step: settle knowing whether an engine of another replica failed, and whether one
    took the update (`{"failed_elsewhere": bool, "updated_elsewhere": bool}`), continue, open; its report."""
    slot = app[UPDATE_SLOT]
    pending, slot.pending = slot.pending, None
    if pending is None:
        raise BadRequest(
            "no weight update was begun here (or it finished by itself)", status=409, code="no_update_begun"
        )
    if pending.expiry is not None:
        pending.expiry.cancel()
    return await finish_update(
        app,
        pending,
        failed_elsewhere=bool(body.get("failed_elsewhere", True)),
        updated_elsewhere=bool(body.get("updated_elsewhere", True)),  # not told: perhaps, so settle
    )


async def _finish_unless_told(app: web.Application, pending: PendingUpdate) -> None:
    await asyncio.sleep(FINISH_WAIT_S)
    slot = app[UPDATE_SLOT]
    if slot.pending is not pending:
        return
    slot.pending = None
    log.error(
        "no verdict from the fleet's controller %.0f s after this replica's part of a weight update: finished "
        "as if an engine elsewhere had failed (on_failure %s)",
        FINISH_WAIT_S,
        pending.plan.on_failure,
    )
    try:
        await finish_update(app, pending, failed_elsewhere=True, updated_elsewhere=True)
    except Exception:
        log.exception("finishing the weight update nobody confirmed failed")


def add_routes(app: web.Application) -> None:
    app[UPDATE_SLOT] = UpdateSlot()
    app.router.add_post("/admin/update_weights", admin_call(update_all_weights))
