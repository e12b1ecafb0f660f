"""One trainer's call through the RL control plane (server/rl_plane.py) to one engine, and what it does to the
engine's generation told to the core.

Theory of operation: the call is forwarded byte for byte (`RlCall`: plain data, so that in a fleet it crosses
to the replica that owns the engine). SMG forwards a pause and routing goes on sending work to the paused
engine, charging its clients the pause. Here a call that stops an engine generating (SGLang `pause_generation`,
`release_memory_occupation`; vLLM `pause`, `sleep`) holds it: before the call goes out the core is told
(`EnginePaused`: nothing on it is charged, it is not judged hung, nothing new is placed there) and its health
checks are not judged; the call that lets it generate again (`continue_generation`, `resume_memory_occupation`,
`resume`, `wake_up`) releases the hold once the engine answers 2xx. A hold whose call the engine refused is
released at once. After a weight update or a release, the engine's weight version is read again (its
`/server_info`), so discovery shows what the engine holds now, not what it held when it registered; a new
version, or `flush_cache`, tells placement its prefix cache is cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
import orjson
from aiohttp import web

from rolloutgate.core.events import EngineCacheFlushed, EnginePaused, EngineResumed
from rolloutgate.engines.base import UpstreamError
from rolloutgate.engines.upstream_wire import UpstreamProtocolError
from rolloutgate.server.context import GatewayContext
from rolloutgate.server.engine_handle import EngineHandle

__all__ = ("MAX_BODY_BYTES", "Refused", "RlCall", "call_engine")

MAX_BODY_BYTES = 1 << 20  # an engine answer longer than this is cut and flagged `body_truncated`, as SMG does
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


class Refused(Exception):
    """An SMG-side error: `{"error": code, "message", **extra}` with `status`."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.payload = status, {"error": code, "message": message, **extra}


@dataclass(frozen=True, slots=True)
class RlCall:
    """A trainer's `/v1/rl` request as plain data: its route, the query (less `selector`), the body as sent,
    and the headers passed on to the engine."""

    method: str
    route: str  # the request's path, `/v1/rl/...`
    query: tuple[tuple[str, str], ...]
    selector: str | None
    body: bytes
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, request: web.Request, body: bytes) -> RlCall:
        headers = [(h, request.headers[h]) for h in _FORWARDED_HEADERS if h in request.headers]
        content_type = request.headers.get("Content-Type") or ("application/json" if body else None)
        if content_type:
            headers.append(("Content-Type", content_type))
        return cls(
            method=request.method,
            route=request.path,
            query=tuple((k, v) for k, v in request.query.items() if k != "selector"),
            selector=request.query.get("selector"),
            body=body,
            headers=tuple(headers),
        )


async def _send(ctx: GatewayContext, handle: EngineHandle, call: RlCall, path: str) -> dict[str, Any]:
    """The engine's answer in SMG's envelope; raises Refused when it answered nothing."""
    started = time.perf_counter()
    headers = dict(call.headers)
    try:
        if call.method == "POST":  # the trainer's calls: on the engine's lean pool (EngineAdapter.post_raw)
            target = "/" + path + (("?" + urlencode(call.query)) if call.query else "")
            async with asyncio.timeout(ctx.settings.rl_control_timeout):
                status, media, raw = await handle.client.post_raw(
                    target, call.body, headers, limit=MAX_BODY_BYTES + 1
                )
            is_json = media == "application/json"
        else:
            limits = aiohttp.ClientTimeout(total=ctx.settings.rl_control_timeout)
            async with ctx.session.get(
                f"{handle.url}/{path}", params=list(call.query), headers=headers, timeout=limits
            ) as resp:
                raw = await resp.content.read(MAX_BODY_BYTES + 1)
                status, is_json = resp.status, resp.content_type == "application/json"
    except TimeoutError:
        raise Refused(504, "upstream_timeout", f"upstream `{handle.url}` gave no answer") from None
    except (aiohttp.ClientError, OSError, UpstreamProtocolError) as exc:
        raise Refused(502, "upstream_unreachable", f"upstream `{handle.url}` unreachable: {exc}") from None
    envelope: dict[str, Any] = {
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


async def call_engine(ctx: GatewayContext, handle: EngineHandle, call: RlCall, path: str) -> dict[str, Any]:
    """Send `call` to engine-native `path` of one engine, with what it does to the engine told to the core
    before and after (module docstring): SMG's envelope, less `worker_id` (the wire's to name). Raises Refused
    when the engine answered nothing."""
    operation = path.rsplit("/", 1)[-1]
    hold = _HOLDS.get(operation) if call.method == "POST" else None
    if hold is not None:
        _hold(ctx, handle, hold)
    try:
        envelope = await _send(ctx, handle, call, path)
    except Refused:
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
        with contextlib.suppress(UpstreamError):  # discovery keeps the last version read; a probe renews it
            await ctx.pool.renew_info(handle)
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
