"""Every route's guard: the handler count and the drain check, and errors as OpenAI JSON.

Theory of operation: this is what an aiohttp middleware would do, as a wrapper each route's handler is
registered with (`guarded`). With any middleware at all, aiohttp runs its own current-app middleware too, and
each is a coroutine frame resumed every time the handler is, and held for as long as a stream runs: two frames
per request and ~3% of the gateway's CPU at 32 connections (docs/benchmarks.md). The inference handlers
(server/front.py) inline the guard instead (`enter`, `leave`, `error_response`), so a request is one frame.

- While the gateway drains (shutdown), new requests get 503 + Retry-After, except `/health` and `/metrics`.
- `ctx.active_requests` counts running handlers: what a graceful shutdown waits for.
- A `GatewayError` becomes its JSON answer (4xx ones are counted by code); aiohttp's HTTP exceptions and a
  `ValueError` (a malformed header aiohttp refused) become OpenAI-shaped errors; any other exception is a
  gateway bug: logged with its traceback, answered 500. Cancellation and a reset client pass through.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps

from aiohttp import web

from rolloutgate.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge, Unavailable
from rolloutgate.server.context import CONTEXT, GatewayContext

__all__ = ("Handler", "enter", "error_response", "guarded", "leave")

log = logging.getLogger("rolloutgate")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ANSWERED_WHILE_DRAINING = frozenset({"/health", "/metrics"})


def enter(request: web.Request) -> GatewayContext:
    """Count the request as running; raises Unavailable while draining. Pair with `leave` when it returns."""
    ctx = request.app[CONTEXT]
    if ctx.draining and request.path not in _ANSWERED_WHILE_DRAINING:
        raise Unavailable("the gateway is shutting down; retry on another replica", retry_after_s=1)
    ctx.active_requests += 1
    return ctx


def leave(ctx: GatewayContext) -> None:
    ctx.active_requests -= 1


def error_response(request: web.Request, error: Exception) -> web.StreamResponse:
    """The answer to an exception a handler raised; re-raises a reset client's error and aiohttp's
    non-error HTTP exceptions (redirects), which aiohttp handles itself."""
    if isinstance(error, GatewayError):
        if error.status < 500:
            request.app[CONTEXT].metrics.bad_requests.labels(code=error.code).inc()
        return _json_error(error)
    if isinstance(error, web.HTTPException):
        return _json_error(_from_http_exception(request, error))
    if isinstance(error, ConnectionResetError):
        raise error
    if isinstance(error, ValueError):  # e.g. a malformed header value aiohttp refused to parse
        return _json_error(BadRequest(str(error)))
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=error)
    return _json_error(GatewayError("internal gateway error"))


def guarded(handler: Handler) -> Handler:
    """`handler` behind the guard (module docstring)."""

    @wraps(handler)
    async def guarded_handler(request: web.Request) -> web.StreamResponse:
        try:
            ctx = enter(request)
            try:
                return await handler(request)
            finally:
                leave(ctx)
        except Exception as error:  # CancelledError is a BaseException: it passes
            return error_response(request, error)

    return guarded_handler


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> GatewayError:
    if exc.status == 413:
        return PayloadTooLarge(exc.text or "request body too large")
    if exc.status == 404:
        return NotFound(f"no route for {request.method} {request.path}")
    if exc.status < 400:
        raise exc
    return BadRequest(exc.reason, status=exc.status, code=exc.reason.lower().replace(" ", "_"))


def _json_error(error: GatewayError) -> web.Response:
    return web.Response(status=error.status, body=error.body(), headers=error.headers())
