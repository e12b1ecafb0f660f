"""aiohttp routes of the session API (a drop-in for the miles session server), over a `SessionService`.

    POST   /sessions [{"max_seq_len": N}]          -> {"session_id": ...} (N: its token budget, token_budget.py)
    GET    /sessions/{id}[?prompt_ids=delta]       -> {"session_id", "records": [...], "metadata": {...}}
    DELETE /sessions/{id}                          -> 204
    GET    /sessions/{id}/trajectory               -> token ids, loss mask, logprobs (JSON)
    POST   /sessions/{id}/samples                  -> miles' samples, safetensors (samples_wire.py)
    POST   /sessions/{id}/v1/chat/completions      -> one recorded turn (TITO with a tokenizer)
    *      /sessions/{id}/<path>                   -> proxied with the session id as routing key

An agent given the base URL `.../sessions/{id}/v1` uses the OpenAI SDK or LiteLLM unchanged.

Theory of operation (chat): the turn runs as a task while the handler waits. If it is not done within the
keep-alive interval, the handler commits a 200 and writes keep-alive bytes (SSE comments for a streaming
client, spaces before the JSON body otherwise) so the client's read timeout never fires while the gateway
queues, pauses or waits out other requests' prefill. An error after that point is framed as the gateway's
front frames it (rolloutgate/framing.py): every client raises once and none retries, so a failed turn starts
no second generation. A streaming client gets the
finished turn as `chat.completion.chunk` events at the end. A client that goes away cancels the turn
(`Dispatcher` contract), and the turn is not recorded.

Mount with `add_session_routes(app, service)` before any catch-all route of the app.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

import orjson
from aiohttp import web

from rolloutgate import token_budget
from rolloutgate.errors import BadRequest, GatewayError
from rolloutgate.framing import JSON_KEEPALIVE, SSE_DONE, SSE_KEEPALIVE, error_after_keepalive, forwardable
from rolloutgate.sessions import tito
from rolloutgate.sessions.samples_wire import CONTENT_TYPE
from rolloutgate.sessions.service import ChatOutcome, SessionService

__all__ = (
    "SESSION_SERVICE",
    "Authorize",
    "Handler",
    "KeepAliveInterval",
    "ProxyHandler",
    "add_session_routes",
    "default_keepalive",
)

SESSION_SERVICE: web.AppKey[SessionService] = web.AppKey("rolloutgate_sessions", SessionService)

# (request, client streams) -> seconds between keep-alive bytes, or None for none
KeepAliveInterval = Callable[[web.Request, bool], "float | None"]
# (request, session id, path after the session prefix) -> the response; for proxied paths
ProxyHandler = Callable[[web.Request, str, str], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorShape = Literal["openai", "miles"]
# raises a GatewayError (e.g. 401) for a request that may not use the API
Authorize = Callable[[web.Request], None]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_JSON = {"Content-Type": "application/json"}
_DISCONNECT_POLL_S = 1.0  # how often a waiting handler checks that its client is still there


def default_keepalive(interval_s: float = 15.0) -> KeepAliveInterval:
    """Every `interval_s`, or half the client's announced read timeout (`x-stainless-read-timeout`) if less;
    `X-Rolloutgate-Keepalive: off` turns it off for one request."""

    def choose(request: web.Request, streams: bool) -> float | None:
        if (request.headers.get("X-Rolloutgate-Keepalive") or "").lower() == "off" or interval_s <= 0:
            return None
        interval = interval_s
        try:
            announced = float(request.headers.get("x-stainless-read-timeout") or 0)
        except ValueError:
            announced = 0.0
        return min(interval, announced / 2) if announced > 0 else interval

    return choose


def add_session_routes(
    app: web.Application,
    service: SessionService,
    *,
    keepalive: KeepAliveInterval | None = None,
    proxy: ProxyHandler | None = None,
    authorize: Authorize | None = None,
    wrap: Callable[[Handler], Handler] | None = None,
    sweep_interval_s: float = 30.0,
    error_shape: ErrorShape = "openai",
) -> None:
    """Mount the session API on `app`; also starts a task that evicts idle sessions every `sweep_interval_s`.

    `keepalive` chooses the keep-alive interval per request, `proxy` serves the other paths (default: through
    the dispatcher, buffered), `authorize` checks every request first (e.g. the gateway's API keys), `wrap` wraps every handler (e.g. the
    gateway's guard: drain refusal, running-handler count, errors as JSON). `error_shape`: the session server's
    own errors as OpenAI error objects, or as miles' session server writes them (`{"error": "<message>"}`).
    """
    app[SESSION_SERVICE] = service
    choose = keepalive or default_keepalive()

    def _errors(handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            try:
                if authorize is not None:
                    authorize(request)
                return await handler(request)
            except GatewayError as error:
                body = _error_body(error, error_shape)
                return web.Response(status=error.status, body=body, headers=error.headers())

        return wrapped if wrap is None else wrap(wrapped)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _chat(request, service, choose, error_shape)

    async def proxied(request: web.Request) -> web.StreamResponse:
        session_id, tail = request.match_info["session_id"], "/" + request.match_info["tail"]
        if proxy is not None:
            service.registry.get(session_id, service.clock.now())  # 404/410 before proxying
            return await proxy(request, session_id, tail)
        answer = await service.proxy(
            session_id,
            request.method,
            tail,
            query=request.query_string,
            body=await request.read(),
            headers=_forward_headers(request),
        )
        headers = forwardable(answer.headers, to_engine=False)
        if not any(k.lower() == "content-type" for k in headers):
            headers.update(_JSON)  # engines answer JSON; a dispatcher may not pass the header on
        return web.Response(status=answer.status, body=answer.body, headers=headers)

    app.router.add_post("/sessions", _errors(lambda r: _create(r, service)))
    app.router.add_get("/sessions/{session_id}", _errors(lambda r: _describe(r, service)))
    app.router.add_delete("/sessions/{session_id}", _errors(lambda r: _delete(r, service)))
    app.router.add_get("/sessions/{session_id}/trajectory", _errors(lambda r: _trajectory(r, service)))
    app.router.add_post("/sessions/{session_id}/samples", _errors(lambda r: _samples(r, service)))
    app.router.add_post("/sessions/{session_id}/v1/chat/completions", _errors(chat))
    app.router.add_route("*", "/sessions/{session_id}/{tail:.*}", _errors(proxied))

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


async def _create(request: web.Request, service: SessionService) -> web.StreamResponse:
    """miles posts `{}`; a body may carry the session's `max_seq_len` (other fields are ignored)."""
    body = _json_body(await request.read())
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise BadRequest("the session request must be a JSON object")
    max_seq_len = token_budget.parse_max_seq_len(body.get("max_seq_len"), param="max_seq_len")
    session_id = service.create(max_seq_len)
    await service.settled(session_id)
    return _json({"session_id": session_id})


def _json_body(raw: bytes) -> Any:
    """A request's JSON body ({} when empty). Raises BadRequest."""
    try:
        return orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc


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


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), headers=_JSON)


def _forward_headers(request: web.Request) -> dict[str, str]:
    return forwardable(request.headers, to_engine=True)  # the service looks them up without case


def _error_body(error: GatewayError, shape: ErrorShape) -> bytes:
    return error.body() if shape == "openai" else orjson.dumps({"error": error.message})


async def _chat(
    request: web.Request, service: SessionService, choose: KeepAliveInterval, error_shape: ErrorShape
) -> web.StreamResponse:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    streams = isinstance(body, dict) and bool(body.get("stream"))
    turn = asyncio.ensure_future(
        service.chat(request.match_info["session_id"], body, _forward_headers(request))
    )
    interval = choose(request, streams)
    poll_s = _DISCONNECT_POLL_S if interval is None else min(interval, _DISCONNECT_POLL_S)
    loop = asyncio.get_running_loop()
    silent_since = loop.time()
    response: web.StreamResponse | None = None
    try:
        while not turn.done():
            await asyncio.wait({turn}, timeout=poll_s)
            if turn.done():
                break
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("the client went away")
            if interval is None or loop.time() - silent_since < interval * 0.999:
                continue
            if response is None:
                response = web.StreamResponse(status=200, headers=_SSE_HEADERS if streams else _JSON)
                await response.prepare(request)
            await response.write(SSE_KEEPALIVE if streams else JSON_KEEPALIVE)
            silent_since = loop.time()
    except (asyncio.CancelledError, ConnectionResetError):
        turn.cancel()  # the agent left: its turn is abandoned upstream and not recorded
        raise
    try:
        outcome = turn.result()
    except GatewayError as error:
        body = _error_body(error, error_shape)
        return await _write_error(response, error.status, body, error.headers(), streams)
    if outcome.completion is None:
        return await _write_error(
            response,
            outcome.status,
            outcome.error_body or b"{}",
            dict(outcome.error_headers),
            streams,
        )
    return await _write_completion(request, response, outcome, streams)


def _outcome_headers(outcome: ChatOutcome) -> dict[str, str]:
    headers = {"X-Rolloutgate-Session-Recorded": "true" if outcome.recorded else "false"}
    if outcome.timing is not None:
        headers["X-Rolloutgate-Timing"] = outcome.timing.header_value()
    if outcome.engine_id is not None:
        headers["X-Rolloutgate-Engine"] = outcome.engine_id
    return headers


async def _write_completion(
    request: web.Request,
    response: web.StreamResponse | None,
    outcome: ChatOutcome,
    streams: bool,
) -> web.StreamResponse:
    assert outcome.completion is not None
    if not streams:
        if response is None:
            return web.Response(
                body=orjson.dumps(outcome.completion), headers={**_JSON, **_outcome_headers(outcome)}
            )
        completion = dict(outcome.completion)
        if outcome.timing is not None:  # the headers left with the first keep-alive byte
            completion["rolloutgate_timing"] = outcome.timing.as_dict()
        await response.write(orjson.dumps(completion))
        await response.write_eof()
        return response
    if response is None:
        response = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **_outcome_headers(outcome)})
        await response.prepare(request)
    for chunk in tito.completion_chunks(outcome.completion):
        await response.write(b"data: " + chunk + b"\n\n")
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


async def _write_error(
    response: web.StreamResponse | None,
    status: int,
    body: bytes,
    headers: dict[str, str],
    streams: bool,
) -> web.StreamResponse:
    if response is None:
        kept = forwardable(headers, to_engine=False)
        return web.Response(status=status, body=body, headers={**_JSON, **kept})
    await response.write_eof(error_after_keepalive(body, streams=streams, status=status))
    return response
