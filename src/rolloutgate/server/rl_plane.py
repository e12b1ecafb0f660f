"""The SGLang Model Gateway's RL control plane on rolloutgate's wire (`/v1/rl`), so that a trainer written for
SMG (its `smg.rl` client) runs unchanged here.

    GET  /v1/rl/workers                        the engines, with capabilities and their weight version
    GET  /v1/rl/workers/{id}                   one of them (404 worker_not_found)
    GET|POST /v1/rl/workers/{id}/engine/{path} one engine-native call to one engine, its answer in an envelope
    GET|POST /v1/rl/engine/{path}?selector=    the same call to every engine the label selector matches, at
                                               most `rl_fanout_concurrency` at once: 200 when each answered
                                               2xx, else 207, each engine's result reported

The wire is SMG's, field for field (its RL control plane docs): envelopes `{worker_id, url, status,
latency_ms, body}`, fan-out `{results, failed, total, succeeded}`, errors `{"error": code, "message"}` with
SMG's codes (`invalid_engine_path`, `selector_required`, `invalid_selector` with `offset`, `no_workers_match`,
`worker_not_found`, `upstream_unreachable`, `upstream_timeout`, `upstream_error`). Nothing is retried: a refit is
not idempotent. What a call does to an engine's generation is told to the core: server/rl_engine_call.py.

Theory of operation: a call is answered in two steps, so that one gateway and a fleet share them. `answer_part`
is one gateway's part: the engines of its own pool that the call names, called, each outcome kept. `compose`
makes SMG's answer from the parts, and from the engines no part could reach (`Unreached`: in a fleet, those
whose owner did not answer: fleet/operations.py). One gateway composes its one part; in a fleet every replica
answers its part for the engines it owns (worker ids are then the fleet's, `engine_fleet_id`), and the
controller composes. A fan-out counts an unreached engine as failed whatever the selector (its labels are
not known), so a pause through the fleet never reads "paused" where it did not arrive.

Who may call: an admin (`check_admin`), as for SMG's control-plane routes.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

from rolloutgate.core.engine_state import EngineState
from rolloutgate.engines.base import EngineFamily
from rolloutgate.server.answer import Answer
from rolloutgate.server.auth import check_admin
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.engine_handle import PENDING, EngineHandle
from rolloutgate.server.guard import guarded
from rolloutgate.server.rl_engine_call import Refused, RlCall, call_engine
from rolloutgate.server.rl_selector import Selector, SelectorError, parse_selector

__all__ = ("ROUTE_PREFIX", "IdOf", "RlCall", "Unreached", "add_routes", "answer_part", "compose", "own_id")

PROTOCOL_VERSION = 1  # SMG's `/v1/rl` wire contract
ROUTE_PREFIX = "/v1/rl/"
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")

IdOf = Callable[[EngineHandle], str]  # an engine's worker id on the wire


def own_id(handle: EngineHandle) -> str:
    """One gateway's worker ids: its pool's own (`engine-N`)."""
    return handle.engine_id


_CAPABILITIES: dict[EngineFamily, dict[str, Any]] = {
    EngineFamily.SGLANG: {
        "pause_modes": ["abort", "retract", "in_place"],
        "update_from": ["disk", "tensor", "distributed"],
        "abort": True,
        "flush_cache": True,
        "sleep_wake": True,
        "reports_weight_version": True,
    },
    EngineFamily.VLLM: {
        "pause_modes": ["abort", "wait", "keep"],
        "update_from": ["disk", "distributed"],
        "abort": False,
        "flush_cache": False,
        "sleep_wake": True,
        "reports_weight_version": False,
    },
}
_NO_CAPABILITIES: dict[str, Any] = {
    "pause_modes": [],
    "update_from": [],
    "abort": False,
    "flush_cache": False,
    "sleep_wake": False,
    "reports_weight_version": False,
}
_HEALTH = {
    EngineState.HEALTHY.value: "ready",
    EngineState.UNHEALTHY.value: "not_ready",
    EngineState.QUARANTINED.value: "failed",
    PENDING: "pending",
}


# --- discovery ---------------------------------------------------------------------------------------------


def _labels(ctx: GatewayContext, handle: EngineHandle, id_of: IdOf) -> dict[str, str]:
    """The worker's labels with the keys SMG derives from its registry, which take precedence."""
    info = handle.info
    labels: dict[str, str] = {}
    if info.models:
        labels["model_path"] = info.models[0]
    if info.weight_version is not None:
        labels["weight_version"] = info.weight_version
    state = ctx.pool.engine_state(handle.engine_id)
    labels.update(
        id=id_of(handle),
        url=handle.url,
        base_url=handle.url,
        engine=info.family.value,
        model=info.models[0] if info.models else "",
        worker_type="regular",
        connection_mode="http",
        health=_HEALTH.get(state or "", "not_ready"),
    )
    return labels


def _worker(ctx: GatewayContext, handle: EngineHandle, id_of: IdOf) -> dict[str, Any]:
    labels = _labels(ctx, handle, id_of)
    return {
        "id": id_of(handle),
        "url": handle.url,
        "base_url": handle.url,
        "engine": labels["engine"],
        "engine_version": None,
        "model_id": labels["model"],
        "worker_type": "regular",
        "connection_mode": "http",
        "tp_size": None,
        "dp_size": None,
        "pp_size": None,
        "dp_ranks": 1,
        "role": None,
        "health": labels["health"],
        "weight_version": handle.info.weight_version,
        "labels": labels,
        "capabilities": {"source": "static", **_CAPABILITIES.get(handle.info.family, _NO_CAPABILITIES)},
        # beyond SMG: whether it generates now, and what holds it
        "held": sorted(handle.control_holds),
        "paused": bool(handle.control_holds) or handle.paused_by_engine,
        "version_lag": ctx.pool.versions.lags.get(handle.engine_id, 0),  # versions behind the pool's newest
    }


# --- the route ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Route:
    kind: Literal["workers", "worker", "call", "fanout"]
    worker_id: str | None = None
    path: str = ""  # the engine-native path, checked
    selector: Selector | None = None


def _engine_path(raw: str) -> str:
    """SMG's path rules: 1 to 4 segments of `A-Z a-z 0-9 . _ -`, none empty, `.` or `..`."""
    segments = raw.lstrip("/").split("/")
    if not 1 <= len(segments) <= 4 or any(
        s in ("", ".", "..") or _SEGMENT.fullmatch(s) is None for s in segments
    ):
        raise Refused(400, "invalid_engine_path", f"invalid engine path {raw!r}")
    return "/".join(segments)


def _parse_route(call: RlCall) -> _Route:
    """What a `/v1/rl` call asks; raises Refused (SMG's errors, 404 and 405 for what is no route)."""
    tail = call.route.removeprefix(ROUTE_PREFIX)
    head, _, rest = tail.partition("/")
    if head == "engine" and rest:
        _allow(call, ("GET", "POST"))
        text = call.selector or ""
        if not text.strip():
            raise Refused(400, "selector_required", "a selector is required (?selector=key=value)")
        try:
            selector = parse_selector(text)
        except SelectorError as exc:
            raise Refused(400, "invalid_selector", str(exc), offset=exc.offset) from None
        return _Route("fanout", path=_engine_path(rest), selector=selector)
    if head == "workers":
        worker_id, _, engine = rest.partition("/")
        if not rest:
            _allow(call, ("GET",))
            return _Route("workers")
        if not engine:
            _allow(call, ("GET",))
            return _Route("worker", worker_id=worker_id)
        kind, _, path = engine.partition("/")
        if worker_id and kind == "engine" and path:
            _allow(call, ("GET", "POST"))
            return _Route("call", worker_id=worker_id, path=_engine_path(path))
    raise Refused(404, "not_found", f"no route {call.route!r}")


def _allow(call: RlCall, methods: tuple[str, ...]) -> None:
    if call.method not in methods:
        raise Refused(405, "method_not_allowed", f"{call.route} takes {' or '.join(methods)}")


# --- one gateway's part ------------------------------------------------------------------------------------


async def answer_part(ctx: GatewayContext, call: RlCall, id_of: IdOf) -> Answer:
    """This gateway's part of `call` (module docstring): the rows of its engines for discovery, the outcome of
    each engine of its pool the call names for an engine call. A call that is no route, or bad, answers its
    error. Every part names the engines its pool held (`Answer.engines`)."""
    try:
        route = _parse_route(call)
    except Refused as refused:
        return Answer(refused.status, refused.payload)
    handles = list(ctx.pool.engines.values())
    held = tuple(h.url for h in handles)
    if route.kind in ("workers", "worker"):
        rows = [_worker(ctx, h, id_of) for h in handles if route.worker_id in (None, id_of(h))]
        return Answer(200, {"workers": rows}, engines=held)
    if route.selector is not None:
        selector = route.selector
        targets = [h for h in handles if selector.matches(_labels(ctx, h, id_of))]
    else:
        targets = [h for h in handles if id_of(h) == route.worker_id]
    limit = asyncio.Semaphore(ctx.settings.rl_fanout_concurrency)

    async def one(handle: EngineHandle) -> dict[str, Any]:
        async with limit:
            try:
                return {
                    "envelope": {
                        "worker_id": id_of(handle),
                        **await call_engine(ctx, handle, call, route.path),
                    }
                }
            except Refused as refused:
                payload = {**refused.payload, "worker_id": id_of(handle), "url": handle.url}
                return {"refused": payload, "status": refused.status}

    outcomes = await asyncio.gather(*(one(h) for h in targets))
    return Answer(
        200, {"outcomes": {id_of(h): o for h, o in zip(targets, outcomes, strict=True)}}, engines=held
    )


# --- SMG's answer ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unreached:
    """An engine no part could reach (its owner did not answer), and why."""

    worker_id: str
    url: str
    why: str


def compose(call: RlCall, parts: Sequence[Answer], unreached: Sequence[Unreached] = ()) -> Answer:
    """SMG's answer to `call` from the parts of every gateway that answered (module docstring)."""
    try:
        route = _parse_route(call)
    except Refused as refused:
        return Answer(refused.status, refused.payload)
    refusal = next((p for p in parts if p.status != 200), None)
    if refusal is not None:  # every part judged the same call: the first one's error is the caller's
        return refusal
    if route.kind in ("workers", "worker"):
        rows = sorted((w for p in parts for w in p.json["workers"]), key=lambda w: w["base_url"])
        if route.kind == "workers":
            body: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "workers": rows, "total": len(rows)}
            if unreached:  # beyond SMG: the engines whose owner did not answer
                body["unreached"] = [{"id": u.worker_id, "url": u.url, "why": u.why} for u in unreached]
            return Answer(200, body)
        if rows:
            return Answer(200, rows[0])
        return _not_found(route.worker_id or "", unreached)
    outcomes: dict[str, dict[str, Any]] = {}
    for part in parts:
        outcomes.update(part.json["outcomes"])
    if route.kind == "call":
        outcome = outcomes.get(route.worker_id or "")
        if outcome is None:
            return _not_found(route.worker_id or "", unreached)
        if "refused" in outcome:
            return Answer(outcome["status"], outcome["refused"])
        return Answer(outcome["envelope"]["status"], outcome["envelope"])
    return _fan_out_report(outcomes, unreached)


def _not_found(worker_id: str, unreached: Sequence[Unreached]) -> Answer:
    gone = next((u for u in unreached if u.worker_id == worker_id), None)
    if gone is not None:
        message = f"upstream `{gone.url}` unreachable: {gone.why}"
        return Answer(502, {"error": "upstream_unreachable", "message": message, "worker_id": worker_id})
    return Answer(404, {"error": "worker_not_found", "message": f"no worker {worker_id!r}", "id": worker_id})


def _fan_out_report(outcomes: dict[str, dict[str, Any]], unreached: Sequence[Unreached]) -> Answer:
    total = len(outcomes) + len(unreached)
    if total == 0:
        return Answer(400, {"error": "no_workers_match", "message": "no worker matches the selector"})
    results: dict[str, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    for worker_id, outcome in outcomes.items():
        if "refused" in outcome:
            refused = outcome["refused"]
            failed.append({k: refused[k] for k in ("worker_id", "url", "error", "message")})
            continue
        envelope = results[worker_id] = outcome["envelope"]
        if not 200 <= envelope["status"] < 300:
            failed.append(
                {
                    "worker_id": worker_id,
                    "url": envelope["url"],
                    "error": "upstream_error",
                    "message": f"HTTP {envelope['status']}",
                    "status": envelope["status"],
                }
            )
    for gone in unreached:
        message = f"upstream `{gone.url}` unreachable: {gone.why}"
        failed.append(
            {
                "worker_id": gone.worker_id,
                "url": gone.url,
                "error": "upstream_unreachable",
                "message": message,
            }
        )
    failed.sort(key=lambda f: f["worker_id"])
    report = {"results": results, "failed": failed, "total": total, "succeeded": total - len(failed)}
    return Answer(207 if failed else 200, report)


# --- one gateway's routes ----------------------------------------------------------------------------------


async def _serve(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    call = RlCall.of(request, await request.read())
    return compose(call, [await answer_part(ctx, call, own_id)]).response()


def add_routes(app: web.Application) -> None:
    app.router.add_route("*", ROUTE_PREFIX + "{tail:.*}", guarded(_serve))
