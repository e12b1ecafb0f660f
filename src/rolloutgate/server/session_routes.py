"""The session API's routes (a drop-in for miles' session server), over a `SessionService` (sessions/).

    POST   /sessions [{"max_seq_len": N}]          -> {"session_id": ...} (N: its token budget, token_budget.py)
    GET    /sessions/{id}[?prompt_ids=delta]       -> {"session_id", "records": [...], "metadata": {...}}
    DELETE /sessions/{id}                          -> 204
    GET    /sessions/{id}/trajectory               -> token ids, loss mask, logprobs (JSON)
    POST   /sessions/{id}/samples                  -> miles' samples, safetensors (sessions/samples_wire.py)
    POST   /sessions/{id}/v1/chat/completions      -> one recorded turn (TITO with a tokenizer)
    *      /sessions/{id}/<path>                   -> the gateway's route for <path>, the session as routing key

An agent given the base URL `.../sessions/{id}/v1` uses the OpenAI SDK or LiteLLM unchanged.

Theory of operation (chat): the turn is begun at once (`SessionService.begin_chat`: read, planned, rendered,
in flight), so what the session refuses is raised here and answered by the guard like any bad request
(counted in `bad_requests`). It then runs as a task that hands its outcome to an outbox, and the front's
writer (server/respond.py `write_outcome`) answers the client from it as it answers every call: the same
keep-alive policy and bytes while the turn queues, pauses or waits out other requests' prefill, the same
headers and timing, an error after keep-alive framed so every client raises once and none retries, and a
client that leaves cancels the turn (not recorded). A streaming client gets the finished turn as
`chat.completion.chunk` events. The turn's request id is the one the gateway's call, the engine's `rid` and
the session's record carry.

The session server's own errors are OpenAI error objects, or with `--session-error-shape miles` miles'
`{"error": "<message>"}`; an engine's error is relayed as the engine wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

from rolloutgate import token_budget
from rolloutgate.errors import BadRequest, GatewayError
from rolloutgate.framing import forwardable
from rolloutgate.server.auth import check_api_key
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.exchange import Finished, Outbox
from rolloutgate.server.front import ROUTES, proxy_path, read_body, serve_inference
from rolloutgate.server.guard import guarded
from rolloutgate.server.respond import keepalive_for, write_outcome
from rolloutgate.sessions import tito
from rolloutgate.sessions.samples_wire import CONTENT_TYPE
from rolloutgate.sessions.service import ChatTurn, SessionService

__all__ = ("ErrorShape", "TurnReply", "add_session_routes")

log = logging.getLogger("rolloutgate.sessions")

ErrorShape = Literal["openai", "miles"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_JSON = {"Content-Type": "application/json"}


@dataclass(slots=True)
class TurnReply:
    """A session turn as the writer answers it (server/respond.py `Answering`)."""

    request_id: str
    client_streams: bool
    engine_url: str | None = None
    committed: bool = False


def add_session_routes(
    app: web.Application,
    service: SessionService,
    *,
    error_shape: ErrorShape = "openai",
    sweep_interval_s: float = 30.0,
) -> None:
    """Mount the session API on the gateway's `app` (before its catch-all route); also starts a task that
    evicts idle sessions every `sweep_interval_s` real seconds."""

    def route(handler: Callable[[web.Request, SessionService], Awaitable[web.StreamResponse]]) -> Handler:
        async def answer(request: web.Request) -> web.StreamResponse:
            check_api_key(request, request.app[CONTEXT].settings)
            try:
                return await handler(request, service)
            except GatewayError as error:
                raise _in_shape(error, error_shape) from None

        return guarded(answer)

    async def chat(request: web.Request, service: SessionService) -> web.StreamResponse:
        return await _chat(request, service, error_shape)

    app.router.add_post("/sessions", route(_create))
    app.router.add_get("/sessions/{session_id}", route(_describe))
    app.router.add_delete("/sessions/{session_id}", route(_delete))
    app.router.add_get("/sessions/{session_id}/trajectory", route(_trajectory))
    app.router.add_post("/sessions/{session_id}/samples", route(_samples))
    app.router.add_post("/sessions/{session_id}/v1/chat/completions", route(chat))
    app.router.add_route("*", "/sessions/{session_id}/{tail:.*}", route(_proxied))

    async def sweeper(_app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(sweep_interval_s)
                service.expire()

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sweeper)


def _in_shape(error: GatewayError, shape: ErrorShape) -> GatewayError:
    """The session server's own error in the configured shape (an engine's own body stays as it is)."""
    if shape == "miles" and error.raw_body is None:
        error.raw_body = orjson.dumps({"error": error.message})
    return error


# -- the chat turn -------------------------------------------------------------------------------------------


async def _chat(request: web.Request, service: SessionService, error_shape: ErrorShape) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    body = _json_body(await read_body(request, ctx.settings.max_body_bytes))
    streams = isinstance(body, dict) and bool(body.get("stream"))
    turn = service.begin_chat(
        request.match_info["session_id"], body, forwardable(request.headers, to_engine=True)
    )
    reply = TurnReply(request_id=turn.request_id, client_streams=streams)
    outbox = Outbox()
    answer_headers: dict[str, str] = {}  # filled by the turn before it hands over its answer
    answering = asyncio.ensure_future(
        _run_turn(ctx, service, turn, reply, outbox, answer_headers, error_shape)
    )
    keepalive = keepalive_for(
        request.headers,
        streams=streams,
        interval_real_s=ctx.driver.clock.real_seconds(ctx.settings.keepalive_interval),
        non_streaming_default=ctx.settings.keepalive_non_streaming,
        enabled=ctx.engine_clock,
    )
    try:
        return await write_outcome(request, reply, outbox, keepalive, ctx.metrics, ctx.driver, answer_headers)
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        ctx.metrics.client_disconnects.inc()
        answering.cancel()  # the agent left: its turn is abandoned upstream and not recorded
        service.abandon(turn)  # (in case the task never started)
        if isinstance(exc, ConnectionResetError):
            raise asyncio.CancelledError from exc  # as the front does: aiohttp drops the connection quietly
        raise


async def _run_turn(
    ctx: GatewayContext,
    service: SessionService,
    turn: ChatTurn,
    reply: TurnReply,
    outbox: Outbox,
    answer_headers: dict[str, str],
    error_shape: ErrorShape,
) -> None:
    """Run the turn and hand its outcome to the writer: the completion (chunks for a streaming client), or an
    error; never raises (the writer waits for one item)."""
    try:
        outcome = await service.run_chat(turn)
    except GatewayError as error:
        outbox.put_nowait(_in_shape(error, error_shape))
        return
    except Exception as error:  # a gateway bug: the client still gets its answer, the log the traceback
        log.error("session turn %s failed", turn.request_id, exc_info=error)
        outbox.put_nowait(GatewayError("internal gateway error"))
        return
    engine = ctx.pool.engines.get(outcome.engine_id) if outcome.engine_id else None
    reply.engine_url = engine.url if engine is not None else None
    if outcome.completion is None:  # the engine's own error, relayed as it wrote it
        outbox.put_nowait(
            GatewayError(
                f"the engine answered {outcome.status}",
                status=outcome.status,
                raw_body=outcome.error_body or b"{}",
                retry_after_s=_retry_after(outcome.error_headers),
                timing=outcome.timing,
            )
        )
        return
    answer_headers["X-Rolloutgate-Session-Recorded"] = "true" if outcome.recorded else "false"
    assert outcome.timing is not None  # an answer that came through the gateway's queue
    if reply.client_streams:
        outbox.put_events(list(tito.completion_chunks(outcome.completion)))
        outbox.put_nowait(Finished(timing=outcome.timing, engine_url=reply.engine_url))
    else:
        body = orjson.dumps(outcome.completion)
        outbox.put_nowait(Finished(timing=outcome.timing, body=body, engine_url=reply.engine_url))


def _retry_after(headers: Mapping[str, str]) -> float:
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    try:
        return float(value) if value is not None else float("inf")
    except ValueError:
        return float("inf")


# -- the other routes ----------------------------------------------------------------------------------------


async def _create(request: web.Request, service: SessionService) -> web.StreamResponse:
    """miles posts `{}`; a body may carry the session's `max_seq_len` (other fields are ignored)."""
    body = _json_body(await request.read())
    if not isinstance(body, dict):
        raise BadRequest("the session request must be a JSON object")
    max_seq_len = token_budget.parse_max_seq_len(body.get("max_seq_len"), param="max_seq_len")
    session_id = service.create(max_seq_len)
    await service.settled(session_id)
    return _json({"session_id": session_id})


async def _describe(request: web.Request, service: SessionService) -> web.StreamResponse:
    full = request.query.get("prompt_ids", "full") != "delta"
    return _json(service.describe(request.match_info["session_id"], full_prompt_ids=full))


async def _delete(request: web.Request, service: SessionService) -> web.StreamResponse:
    session_id = request.match_info["session_id"]
    service.delete(session_id)
    await service.settled(session_id)
    return web.Response(status=204)


async def _trajectory(request: web.Request, service: SessionService) -> web.StreamResponse:
    return _json(service.trajectory(request.match_info["session_id"]))


async def _samples(request: web.Request, service: SessionService) -> web.StreamResponse:
    payload = service.samples(request.match_info["session_id"], _json_body(await request.read()))
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE})


async def _proxied(request: web.Request, service: SessionService) -> web.StreamResponse:
    """Any other path under a session: the gateway's own route for it, with the session id as routing key
    (not recorded); 404/410 first for a session that is not here."""
    session_id, tail = request.match_info["session_id"], "/" + request.match_info["tail"]
    service.registry.get(session_id, service.clock.now())
    ctx = request.app[CONTEXT]
    route = ROUTES.get(tail)
    if route is not None:
        return await serve_inference(ctx, request, route, session_id)
    query = f"?{request.query_string}" if request.query_string else ""
    return await proxy_path(ctx, request, tail + query)


def _json_body(raw: bytes) -> Any:
    """A request's JSON body ({} when empty). Raises BadRequest."""
    try:
        return orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), headers=_JSON)
