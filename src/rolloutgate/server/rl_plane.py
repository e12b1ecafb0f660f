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
not idempotent.

Beyond SMG, the gateway knows what the calls do. SMG forwards a pause and routing goes on sending work to the
paused engine, charging its clients the pause. Here a call that stops an engine generating (SGLang
`pause_generation`, `release_memory_occupation`; vLLM `pause`, `sleep`) holds it: before the call goes out the
core is told (`EnginePaused`: nothing on it is charged, it is not judged hung, nothing new is placed there) and
its health checks are not judged; the call that lets it generate again (`continue_generation`,
`resume_memory_occupation`, `resume`, `wake_up`) releases the hold once the engine answers 2xx. A hold whose
call the engine refused is released at once. After a weight update or a release, the engine's weight version
is read again (its `/server_info`), so discovery shows what the engine holds now, not what it held when it
registered; a new version, or `flush_cache`, tells placement its prefix cache is cold.

Who may call: an admin (`check_admin`), as for SMG's control-plane routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

import aiohttp
import orjson
from aiohttp import web

from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.events import EngineCacheFlushed, EnginePaused, EngineResumed
from rolloutgate.engines.base import EngineFamily, UpstreamError
from rolloutgate.engines.upstream_wire import UpstreamProtocolError
from rolloutgate.server.auth import check_admin
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.guard import guarded
from rolloutgate.server.pool import PENDING, EngineHandle
from rolloutgate.server.rl_selector import SelectorError, parse_selector

__all__ = ("add_routes",)

PROTOCOL_VERSION = 1  # SMG's `/v1/rl` wire contract
MAX_BODY_BYTES = 1 << 20  # an engine answer longer than this is cut and flagged `body_truncated`, as SMG does
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
_FORWARDED_HEADERS = ("x-request-id", "traceparent", "tracestate")

# what each call does to an engine's generation: the hold it takes, or the hold it releases (module docstring)
_HOLDS = {
    "pause_generation": "pause",
    "pause": "pause",
    "release_memory_occupation": "sleep",
    "sleep": "sleep",
}
_RELEASES = {
    "continue_generation": "pause",
    "resume": "pause",
    "resume_memory_occupation": "sleep",
    "wake_up": "sleep",
}
_UPDATES = frozenset(
    {
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "update_weights_from_ipc",
        "update_weight_version",
        "update_weights",
    }
)

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


class _Refused(Exception):
    """An SMG-side error: `{"error": code, "message", **extra}` with `status`."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.payload = status, {"error": code, "message": message, **extra}


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")


def _engine_path(raw: str) -> str:
    """SMG's path rules: 1 to 4 segments of `A-Z a-z 0-9 . _ -`, none empty, `.` or `..`."""
    segments = raw.lstrip("/").split("/")
    if not 1 <= len(segments) <= 4 or any(
        s in ("", ".", "..") or _SEGMENT.fullmatch(s) is None for s in segments
    ):
        raise _Refused(400, "invalid_engine_path", f"invalid engine path {raw!r}")
    return "/".join(segments)


# --- discovery ---------------------------------------------------------------------------------------------


def _labels(ctx: GatewayContext, handle: EngineHandle) -> dict[str, str]:
    """The worker's labels with the keys SMG derives from its registry, which take precedence."""
    info = handle.info
    labels: dict[str, str] = {}
    if info.models:
        labels["model_path"] = info.models[0]
    if info.weight_version is not None:
        labels["weight_version"] = info.weight_version
    state = ctx.pool.engine_state(handle.engine_id)
    labels.update(
        id=handle.engine_id,
        url=handle.url,
        base_url=handle.url,
        engine=info.family.value,
        model=info.models[0] if info.models else "",
        worker_type="regular",
        connection_mode="http",
        health=_HEALTH.get(state or "", "not_ready"),
    )
    return labels


def _worker(ctx: GatewayContext, handle: EngineHandle) -> dict[str, Any]:
    labels = _labels(ctx, handle)
    return {
        "id": handle.engine_id,
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


def _handle(ctx: GatewayContext, worker_id: str) -> EngineHandle:
    handle = ctx.pool.engines.get(worker_id)
    if handle is None:
        raise _Refused(404, "worker_not_found", f"no worker {worker_id!r}", id=worker_id)
    return handle


async def workers(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    rows = sorted((_worker(ctx, h) for h in ctx.pool.engines.values()), key=lambda w: w["base_url"])
    return _json({"protocol_version": PROTOCOL_VERSION, "workers": rows, "total": len(rows)})


async def worker(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    try:
        return _json(_worker(ctx, _handle(ctx, request.match_info["worker_id"])))
    except _Refused as refused:
        return _json(refused.payload, refused.status)


# --- engine calls ------------------------------------------------------------------------------------------


class _Call:
    """One engine-native call as the trainer sent it: forwarded byte for byte."""

    __slots__ = ("body", "content_type", "headers", "method", "path", "query")

    def __init__(self, request: web.Request, path: str, body: bytes) -> None:
        self.method, self.path, self.body = request.method, path, body
        self.query = [(k, v) for k, v in request.query.items() if k != "selector"]
        self.content_type = request.headers.get("Content-Type") or ("application/json" if body else None)
        self.headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        if self.content_type:
            self.headers["Content-Type"] = self.content_type

    @property
    def operation(self) -> str:
        return self.path.rsplit("/", 1)[-1]


async def _send(ctx: GatewayContext, handle: EngineHandle, call: _Call) -> dict[str, Any]:
    """The engine's answer in SMG's envelope; raises _Refused when it answered nothing."""
    started = time.perf_counter()
    try:
        if call.method == "POST":  # the trainer's calls: on the engine's lean pool (EngineAdapter.post_raw)
            target = "/" + call.path + (("?" + urlencode(call.query)) if call.query else "")
            async with asyncio.timeout(ctx.settings.rl_control_timeout):
                status, media, raw = await handle.client.post_raw(
                    target, call.body, call.headers, limit=MAX_BODY_BYTES + 1
                )
            is_json = media == "application/json"
        else:
            limits = aiohttp.ClientTimeout(total=ctx.settings.rl_control_timeout)
            async with ctx.session.get(
                f"{handle.url}/{call.path}", params=call.query, headers=call.headers, timeout=limits
            ) as resp:
                raw = await resp.content.read(MAX_BODY_BYTES + 1)
                status, is_json = resp.status, resp.content_type == "application/json"
    except TimeoutError:
        raise _Refused(
            504,
            "upstream_timeout",
            f"upstream `{handle.url}` gave no answer",
            worker_id=handle.engine_id,
            url=handle.url,
        ) from None
    except (aiohttp.ClientError, OSError, UpstreamProtocolError) as exc:
        raise _Refused(
            502,
            "upstream_unreachable",
            f"upstream `{handle.url}` unreachable: {exc}",
            worker_id=handle.engine_id,
            url=handle.url,
        ) from None
    envelope: dict[str, Any] = {
        "worker_id": handle.engine_id,
        "url": handle.url,
        "status": status,
        "latency_ms": round((time.perf_counter() - started) * 1000),
        "body": _decoded(raw[:MAX_BODY_BYTES], is_json and len(raw) <= MAX_BODY_BYTES),
    }
    if len(raw) > MAX_BODY_BYTES:
        envelope["body_truncated"] = True
    return envelope


def _decoded(raw: bytes, is_json: bool) -> Any:
    if is_json:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return raw.decode("utf-8", "replace")


async def _call_engine(ctx: GatewayContext, handle: EngineHandle, call: _Call) -> dict[str, Any]:
    """Send one call, with what it does to the engine told to the core before and after (module docstring)."""
    operation = call.operation
    hold = _HOLDS.get(operation) if call.method == "POST" else None
    if hold is not None:
        _hold(ctx, handle, hold)
    try:
        envelope = await _send(ctx, handle, call)
    except _Refused:
        if hold is not None:
            _release(ctx, handle, hold)
        raise
    if not 200 <= envelope["status"] < 300 or call.method != "POST":
        if hold is not None:
            _release(ctx, handle, hold)
        return envelope
    released = _RELEASES.get(operation)
    if released is not None:
        _release(ctx, handle, released)
    if operation in _UPDATES or released is not None:
        await _read_weight_version(ctx, handle)
    elif operation == "flush_cache":
        ctx.driver.handle(EngineCacheFlushed(engine_id=handle.engine_id))
    return envelope


def _hold(ctx: GatewayContext, handle: EngineHandle, hold: str) -> None:
    if not handle.control_holds:
        handle.maintenance += 1  # a paused SGLang fails its health probe: not judged meanwhile
        ctx.driver.handle(EnginePaused(engine_id=handle.engine_id))
    handle.control_holds.add(hold)


def _release(ctx: GatewayContext, handle: EngineHandle, hold: str) -> None:
    if hold not in handle.control_holds:
        return
    handle.control_holds.discard(hold)
    if not handle.control_holds:
        handle.maintenance -= 1
        ctx.driver.handle(EngineResumed(engine_id=handle.engine_id))


async def _read_weight_version(ctx: GatewayContext, handle: EngineHandle) -> None:
    with contextlib.suppress(
        UpstreamError
    ):  # discovery keeps the last version read; the next probe renews it
        await ctx.pool.renew_info(handle)


async def call_one(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    try:
        handle = _handle(ctx, request.match_info["worker_id"])
        call = _Call(request, _engine_path(request.match_info["path"]), await request.read())
        envelope = await _call_engine(ctx, handle, call)
    except _Refused as refused:
        return _json(refused.payload, refused.status)
    return _json(envelope, envelope["status"])


async def fan_out(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    check_admin(request, ctx.settings)
    try:
        path = _engine_path(request.match_info["path"])
        text = request.query.get("selector", "")
        if not text.strip():
            raise _Refused(400, "selector_required", "a selector is required (?selector=key=value)")
        try:
            selector = parse_selector(text)
        except SelectorError as exc:
            raise _Refused(400, "invalid_selector", str(exc), offset=exc.offset) from None
        targets = [h for h in ctx.pool.engines.values() if selector.matches(_labels(ctx, h))]
        if not targets:
            raise _Refused(400, "no_workers_match", f"no worker matches {text!r}", selector=text)
        call = _Call(request, path, await request.read())
    except _Refused as refused:
        return _json(refused.payload, refused.status)
    results, failed = await _each(ctx, targets, call)
    report = {
        "results": results,
        "failed": failed,
        "total": len(targets),
        "succeeded": len(targets) - len(failed),
    }
    return _json(report, 207 if failed else 200)


async def _each(
    ctx: GatewayContext, targets: Iterable[EngineHandle], call: _Call
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    limit = asyncio.Semaphore(ctx.settings.rl_fanout_concurrency)

    async def one(handle: EngineHandle) -> dict[str, Any] | _Refused:
        async with limit:
            try:
                return await _call_engine(ctx, handle, call)
            except _Refused as refused:
                return refused

    handles = list(targets)
    outcomes = await asyncio.gather(*(one(h) for h in handles))
    results: dict[str, dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    for handle, outcome in zip(handles, outcomes, strict=True):
        if isinstance(outcome, _Refused):
            payload = outcome.payload
            failed.append(
                {
                    "worker_id": handle.engine_id,
                    "url": handle.url,
                    "error": payload["error"],
                    "message": payload["message"],
                }
            )
            continue
        results[handle.engine_id] = outcome
        if not 200 <= outcome["status"] < 300:
            failed.append(
                {
                    "worker_id": handle.engine_id,
                    "url": handle.url,
                    "error": "upstream_error",
                    "message": f"HTTP {outcome['status']}",
                    "status": outcome["status"],
                }
            )
    failed.sort(key=lambda f: f["worker_id"])
    return results, failed


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/rl/workers", guarded(workers))
    app.router.add_get("/v1/rl/workers/{worker_id}", guarded(worker))
    for method in ("GET", "POST"):
        app.router.add_route(method, "/v1/rl/workers/{worker_id}/engine/{path:.+}", guarded(call_one))
        app.router.add_route(method, "/v1/rl/engine/{path:.+}", guarded(fan_out))
