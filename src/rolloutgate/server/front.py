"""The inference front: OpenAI chat and completions, SGLang /generate, models, and a proxy for the rest.

A request's path through the gateway: parse and validate here -> `Exchange` + `RequestArrived` to the driver ->
the core queues, admits and places it -> the driver runs it upstream -> `respond.write_outcome` answers.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from rolloutgate import token_budget
from rolloutgate.core.events import RequestArrived, RequestLimits
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest, PayloadTooLarge, Unavailable, UpstreamFailure
from rolloutgate.framing import SSE_DONE, forwardable
from rolloutgate.server.attach import CachedOutcome, key_for
from rolloutgate.server.auth import check_admin, check_api_key
from rolloutgate.server.context import CONTEXT, GatewayContext
from rolloutgate.server.continuation import can_continue_whole
from rolloutgate.server.exchange import Exchange, Outbox
from rolloutgate.server.fleet_versions import VERSION_POLICY_HEADER, VersionPolicyError
from rolloutgate.server.guard import enter, error_response, guarded, leave
from rolloutgate.server.respond import NO_TIMING, KeepAlive, keepalive_for, write_outcome
from rolloutgate.server.validate import (
    NO_OVERRIDES,
    estimate_prompt_tokens,
    parse_inference_body,
    parse_overrides,
    validate_body,
)

__all__ = (
    "GROUP_BODY_FIELD",
    "GROUP_HEADER",
    "ROUTES",
    "ROUTING_KEY_HEADERS",
    "add_proxy_route",
    "add_routes",
    "apply_budget",
    "new_request_id",
    "proxy_path",
    "run_exchange",
    "serve_inference",
    "submit",
)

ROUTING_KEY_HEADERS = ("X-SMG-Routing-Key", "X-Session-Id")
# The n samples of one prompt (core/group_table.py): this header on any route, or this field of an SGLang
# /generate body (miles sends no custom headers there), taken out of the body before it goes to the engine
GROUP_HEADER = "X-Rolloutgate-Group"
GROUP_BODY_FIELD = "rolloutgate_group"
MAX_GROUP_CHARS = 256
_DEFAULT_LIMITS = "front.default_limits"  # ctx.extras key: (settings' budgets, their RequestLimits)
ROUTES = {route.value: route for route in Route}


# Engine paths the catch-all proxy forwards with an API key alone: reads and inference helpers. Anything else
# (weight updates, pause/continue, abort, flush, profiling, memory release, the simulator's /sim/faults) is
# engine control and needs the admin credentials, like the gateway's own admin API.
OPEN_ENGINE_PATHS = frozenset(
    {
        "/v1/models",
        "/get_model_info",
        "/model_info",
        "/get_server_info",
        "/server_info",
        "/health_generate",
        "/get_load",
        "/v1/loads",
        "/version",
        "/tokenize",
        "/detokenize",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/classify",
        "/v1/responses",
        # vLLM's renders (a prompt's ids from a chat, with `--enable-scale-out`; SkyRL's render_chat_completion):
        # a template applied, nothing generated
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
    }
)


def routing_key_of(request: web.Request) -> str | None:
    for name in ROUTING_KEY_HEADERS:
        value = request.headers.get(name)
        if value:
            return value
    return None


def group_of(route: Route, body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    """The call's group: the /generate body's GROUP_BODY_FIELD (taken out of `body`), else the GROUP_HEADER;
    None when absent or blank. Raises BadRequest for one that is not a string or is over MAX_GROUP_CHARS."""
    where, value = GROUP_HEADER, headers.get(GROUP_HEADER)
    if route is Route.GENERATE and GROUP_BODY_FIELD in body:
        where, value = GROUP_BODY_FIELD, body.pop(GROUP_BODY_FIELD)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{where!r} must be a string", param=where, code="invalid_type")
    if len(value) > MAX_GROUP_CHARS:
        raise BadRequest(f"{where!r} is over {MAX_GROUP_CHARS} characters", param=where, code="invalid_group")
    return value.strip() or None


def limits_for(ctx: GatewayContext, headers: Mapping[str, str]) -> tuple[RequestLimits, int]:
    settings = ctx.settings
    overrides = parse_overrides(headers, settings)
    if overrides is NO_OVERRIDES:  # the common case: the server's budgets, one value while they stay the same
        key = (settings.timeout, settings.stall_timeout, settings.queue_timeout_s, settings.max_wall_s)
        cached: tuple[tuple[float, ...], RequestLimits] | None = ctx.extras.get(_DEFAULT_LIMITS)
        if cached is None or cached[0] != key:
            limits = RequestLimits(
                timeout_s=key[0], stall_timeout_s=key[1], queue_timeout_s=key[2], max_wall_s=key[3]
            )
            cached = ctx.extras[_DEFAULT_LIMITS] = (key, limits)
        return cached[1], 0
    limits = RequestLimits(
        timeout_s=overrides.timeout_s or settings.timeout,
        stall_timeout_s=overrides.stall_timeout_s or settings.stall_timeout,
        queue_timeout_s=overrides.queue_timeout_s or settings.queue_timeout_s,
        max_wall_s=overrides.max_wall_s or settings.max_wall_s,
    )
    return limits, overrides.priority


async def run_exchange(
    ctx: GatewayContext,
    request: web.Request,
    route: Route,
    body: dict[str, Any],
    *,
    routing_key: str | None,
    attach_key: str | None = None,
    pinned_engine: str | None = None,
    prompt_tokens: int | None = None,
) -> web.StreamResponse:
    """Submit one validated request, or attach it to its earlier attempt (`attach_key`, server/attach.py),
    and answer its client. `prompt_tokens`: the prompt-length estimate, when the caller has it; else it is
    made here."""
    driver = ctx.driver
    streams = bool(body.get("stream"))
    key = attach_key
    found = ctx.attachments.find(key, driver.clock.now()) if key else None
    if isinstance(found, CachedOutcome):
        ctx.metrics.attachments.labels(kind="cached").inc()
        return await _replay(ctx, request, found)
    if isinstance(found, Exchange) and found.client_streams == streams:
        ctx.metrics.attachments.labels(kind="live").inc()
        exchange = found
        outbox = exchange.subscribe()
        if len(exchange.subscribers) == 1:
            driver.client_attached(exchange)
    else:
        exchange, outbox = submit(
            ctx,
            route,
            body,
            request.headers,
            routing_key=routing_key,
            pinned_engine=pinned_engine,
            prompt_tokens=prompt_tokens,
        )
        if key and not found:
            ctx.attachments.register(key, exchange, driver.clock.now())
    keepalive = keepalive_for(
        request.headers,
        streams=streams,
        interval_real_s=driver.clock.real_seconds(ctx.settings.keepalive_interval),
        non_streaming_default=ctx.settings.keepalive_non_streaming,
        enabled=ctx.engine_clock,
    )

    try:
        response = await write_outcome(request, exchange, outbox, keepalive, ctx.metrics, driver)
        ctx.attachments.delivered(exchange)
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        ctx.metrics.client_disconnects.inc()
        if exchange.unsubscribe(outbox) and ctx.engine_clock:
            driver.client_disconnected(exchange)
        if isinstance(exc, ConnectionResetError):
            # The client left while its answer was being written (aiohttp: "Cannot write to closing
            # transport"). As a cancellation, aiohttp drops the connection quietly; as an error it would log
            # a traceback and try to write a 500 after a partial answer.
            raise asyncio.CancelledError from exc
        raise
    finally:
        exchange.unsubscribe(outbox)
    return response


def submit(
    ctx: GatewayContext,
    route: Route,
    body: dict[str, Any],
    headers: Mapping[str, str],
    *,
    routing_key: str | None,
    pinned_engine: str | None = None,
    prompt_tokens: int | None = None,
    request_id: str | None = None,
) -> tuple[Exchange, Outbox]:
    """The one way a call enters the gateway's queue (the front's and the session API's): a new exchange
    under a new request id (or the caller's, minted by `new_request_id`: a session turn's), its arrival told
    to the core, and the first subscriber's outbox. Raises BadRequest for a malformed group (`group_of`) or a
    prompt that engines died prefilling (server/poison.py)."""
    ctx.driver.poison_prompts.check(route, body)
    limits, priority = limits_for(ctx, headers)
    group = group_of(route, body, headers)
    max_version_lag = version_bound(ctx, headers)
    streams = bool(body.get("stream"))
    stream_options = body.get("stream_options")
    exchange = Exchange(
        request_id=request_id or new_request_id(),
        route=route,
        body=body,
        client_streams=streams,
        forward_headers={"X-SMG-Routing-Key": routing_key} if routing_key else {},
        wants_usage=isinstance(stream_options, dict) and bool(stream_options.get("include_usage")),
        history=[] if streams else None,
        max_buffered_bytes=ctx.settings.client_buffer_bytes,
    )
    outbox = exchange.subscribe()
    ctx.driver.submit(
        exchange,
        RequestArrived(
            request_id=exchange.request_id,
            limits=limits,
            routing_key=routing_key,
            priority=priority,
            prompt_tokens=estimate_prompt_tokens(route, body) if prompt_tokens is None else prompt_tokens,
            streaming=streams,
            continuable=ctx.settings.checkpoint_tokens > 0 and can_continue_whole(route, body),
            pinned_engine=pinned_engine,
            group=group,
            max_version_lag=max_version_lag,
        ),
    )
    return exchange, outbox


def version_bound(ctx: GatewayContext, headers: Mapping[str, str]) -> int | None:
    """How many weight versions behind the pool's newest the request's engine may be (None: any): its
    `x-smg-version-policy`, else the gateway's `--version-policy` (server/fleet_versions.py)."""
    policy = headers.get(VERSION_POLICY_HEADER) or ctx.settings.version_policy
    try:
        return ctx.pool.versions.max_lag(policy.strip())
    except VersionPolicyError as exc:
        raise BadRequest(str(exc), param=VERSION_POLICY_HEADER, code="invalid_version_policy") from None


async def _replay(ctx: GatewayContext, request: web.Request, cached: CachedOutcome) -> web.StreamResponse:
    """Answer a retry from a finished exchange: its stream events again, then its outcome."""
    outbox = cached.exchange.subscribe()
    cached.exchange.unsubscribe(outbox)
    outbox.put_nowait(cached.item)
    try:
        response = await write_outcome(
            request, cached.exchange, outbox, KeepAlive(None), ctx.metrics, NO_TIMING
        )
        ctx.attachments.delivered(cached.exchange)
        return response
    except ConnectionResetError as exc:  # the client left mid-answer: quietly, as in run_exchange
        ctx.metrics.client_disconnects.inc()
        raise asyncio.CancelledError from exc


async def serve_inference(
    ctx: GatewayContext, request: web.Request, route: Route, routing_key: str | None
) -> web.StreamResponse:
    """Parse, validate and run one inference request (the front's routes and the session proxy)."""
    body, attach_key, prompt_tokens, no_room = await _read_request(ctx, request, route, routing_key)
    if no_room is not None:
        return _zero_token_answer(body, no_room)
    return await run_exchange(
        ctx,
        request,
        route,
        body,
        routing_key=routing_key,
        attach_key=attach_key,
        prompt_tokens=prompt_tokens,
    )


async def _read_request(
    ctx: GatewayContext, request: web.Request, route: Route, routing_key: str | None
) -> tuple[dict[str, Any], str | None, int, token_budget.BudgetCap | None]:
    """Count, read, parse and validate an inference request: its body (a prompt of token ids kept as its
    JSON: server/prompt_ids.py; its output limit capped by an `X-Rolloutgate-Max-Seq-Len` budget), its attach
    key, its prompt-length estimate, and the budget's decision when it leaves a `/generate` no room (answered
    with zero tokens, never sent). Raises GatewayError.

    The raw bytes are dropped here: a request's frames and aiohttp's request object live as long as its
    generation, and a 100K-token prompt is ~650 KB of JSON. Its body stays (retries need it)."""
    ctx.metrics.child(ctx.metrics.requests, route.value).inc()
    raw = await read_body(request, ctx.settings.max_body_bytes)
    vocab_size = ctx.pool.vocab_size  # one for both: the parse checks the ids it keeps, validation the rest
    body, prompt_ids = parse_inference_body(raw, route, ctx.settings, vocab_size=vocab_size)
    validate_body(route, body, ctx.settings, vocab_size=vocab_size, kept_checked=True)
    prompt_tokens = estimate_prompt_tokens(route, body) if prompt_ids is None else prompt_ids
    max_seq_len = token_budget.header_budget(request.headers)
    decision = None
    if max_seq_len is not None:
        body, decision = apply_budget(
            ctx, route, body, prompt_tokens=prompt_tokens, max_seq_len=max_seq_len, client_route=route
        )
    attach_key = key_for(request.headers, routing_key, raw) if ctx.engine_clock else None
    no_room = decision if decision is not None and decision.has_no_room else None
    return body, attach_key, prompt_tokens, no_room


def apply_budget(
    ctx: GatewayContext,
    route: Route,
    body: dict[str, Any],
    *,
    prompt_tokens: int,
    max_seq_len: int,
    client_route: Route,
) -> tuple[dict[str, Any], token_budget.BudgetCap]:
    """`body` for `route` with its output limit capped to what `max_seq_len` leaves after the prompt
    (rolloutgate/token_budget.py), the tokens it saved counted. A prompt that fills the budget: 400
    `context_length_exceeded` unless the client speaks `/generate` (`client_route`), whose caller answers
    zero tokens with finish reason `length` (the decision's `has_no_room`). Raises BadRequest."""
    body, decision = token_budget.cap(route, body, prompt_tokens=prompt_tokens, max_seq_len=max_seq_len)
    if decision.has_no_room and client_route is not Route.GENERATE:
        raise token_budget.no_room_error(decision)
    if decision.saved:
        ctx.metrics.budget_tokens_saved.inc(decision.saved)
    return body, decision


def _zero_token_answer(body: dict[str, Any], decision: token_budget.BudgetCap) -> web.Response:
    """SGLang's answer to a `/generate` its budget leaves no room: zero tokens, finish reason `length`."""
    answer = orjson.dumps(token_budget.zero_token_answer(body, decision, new_request_id()))
    if body.get("stream"):
        return web.Response(
            body=b"data: " + answer + b"\n\n" + SSE_DONE, content_type="text/event-stream", charset="utf-8"
        )
    return web.Response(body=answer, content_type="application/json")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (else PayloadTooLarge), not cached on the request (what
    `request.read()` would do for the request's lifetime)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; the limit is {limit}")
    content = request.content
    if content.is_eof():  # the whole body came with the headers (the usual small request): no read loop
        whole = content.read_nowait()
        if len(whole) > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes")
        return whole
    body = bytearray()
    while chunk := await content.readany():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is over {limit} bytes")
    return bytes(body)


def _inference(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The route's handler: `serve_inference` with the API key check, behind the guard (server/guard.py), in
    one coroutine frame: a handler's frames are held, and resumed, for as long as its stream runs."""

    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            ctx = enter(request)
            try:
                check_api_key(request, ctx.settings)
                routing_key = routing_key_of(request)
                body, attach_key, prompt_tokens, no_room = await _read_request(
                    ctx, request, route, routing_key
                )
                if no_room is not None:
                    return _zero_token_answer(body, no_room)
                return await run_exchange(
                    ctx,
                    request,
                    route,
                    body,
                    routing_key=routing_key,
                    attach_key=attach_key,
                    prompt_tokens=prompt_tokens,
                )
            finally:
                leave(ctx)
        except Exception as error:  # CancelledError is a BaseException: it passes
            return error_response(request, error)

    return handler


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    seen: dict[str, dict[str, Any]] = {}
    for engine in ctx.pool.engines.values():
        for model in engine.info.models:
            seen.setdefault(
                model,
                {
                    "id": model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "rolloutgate",
                    "max_model_len": engine.info.max_model_len,
                },
            )
    return web.json_response({"object": "list", "data": list(seen.values())}, dumps=_dumps)


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    healthy = len(ctx.pool.healthy())
    return web.json_response(
        {
            "status": "ok",
            "engines": len(ctx.pool.engines),
            "healthy_engines": healthy,
            "session_server_instance_id": ctx.instance_id,
        },
        dumps=_dumps,
    )


async def ready(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    healthy = len(ctx.pool.healthy())
    if not healthy:
        raise Unavailable("no healthy engine yet", retry_after_s=5)
    return web.json_response({"status": "ready", "healthy_engines": healthy}, dumps=_dumps)


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    return web.Response(body=ctx.metrics.render(), content_type="text/plain", charset="utf-8")


async def proxy(request: web.Request) -> web.StreamResponse:
    """Any other path goes to one healthy engine, unchanged (no queueing or timing). Open engine paths need
    an API key (when keys are set); engine control needs the admin credentials instead (proxy_path)."""
    ctx = request.app[CONTEXT]
    if is_open_engine_path(request.path):
        check_api_key(request, ctx.settings)
    return await proxy_path(ctx, request, request.rel_url.path_qs)


def is_open_engine_path(path: str) -> bool:
    """Engine paths an inference client may reach through the proxy; every other one is engine control."""
    return path in OPEN_ENGINE_PATHS or path.startswith("/v1/models/")


async def proxy_path(ctx: GatewayContext, request: web.Request, path_qs: str) -> web.StreamResponse:
    """Forward `request` to the least busy healthy engine at `path_qs` and stream its answer back.

    Engine control (anything outside OPEN_ENGINE_PATHS) needs the admin credentials. Raises Unavailable
    (no healthy engine) or UpstreamFailure (the engine could not be reached or failed before answering).
    """
    if not is_open_engine_path(path_qs.partition("?")[0]):
        check_admin(request, ctx.settings)
    candidates = ctx.pool.healthy()
    if not candidates:
        raise Unavailable("no healthy engine to proxy to", retry_after_s=5)
    in_flight = ctx.driver.core.stats().in_flight
    engine = min(candidates, key=lambda e: in_flight.get(e.engine_id, 0))
    headers = forwardable(request.headers, to_engine=True)
    body = await request.read()
    try:
        async with ctx.session.request(
            request.method, engine.url + path_qs, headers=headers, data=body or None
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers=forwardable(upstream.headers, to_engine=False),
            )
            await response.prepare(request)
            chunks = upstream.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, OSError):
                    # The status is sent: cut the client's connection so it sees a failure, not a short body.
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, OSError) as exc:
        if isinstance(exc, ConnectionResetError) and (
            request.transport is None or request.transport.is_closing()
        ):
            raise  # our client went away
        raise UpstreamFailure(
            f"the engine failed to answer {request.method} {path_qs}: {type(exc).__name__}"
        ) from None


class _RequestIds:
    """Request ids: 32 hex digits like uuid4().hex, a random prefix per process and a counter. Unique across
    the gateway replicas in front of one engine (the prefix), and no system call per request (os.urandom
    made one: on this VM a getrandom call was a visible share of a request's CPU)."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(int.from_bytes(os.urandom(4), "big"))

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._counter) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


new_request_id = _RequestIds()


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def add_routes(app: web.Application) -> None:
    app.router.add_post(Route.CHAT.value, _inference(Route.CHAT))
    app.router.add_post(Route.COMPLETIONS.value, _inference(Route.COMPLETIONS))
    app.router.add_post(Route.GENERATE.value, _inference(Route.GENERATE))
    app.router.add_post(Route.TOKENS.value, _inference(Route.TOKENS))
    app.router.add_get("/v1/models", guarded(list_models))
    app.router.add_get("/health", guarded(health))
    app.router.add_get("/ready", guarded(ready))
    app.router.add_get("/metrics", guarded(metrics))


def add_proxy_route(app: web.Application) -> None:
    """Registered last: it matches every path the other routes do not."""
    app.router.add_route("*", "/{tail:.*}", guarded(proxy))
