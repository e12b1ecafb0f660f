"""The routes' guard (server/guard.py): what the gateway's middleware did, without aiohttp's middleware frames."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rolloutgate.errors import BadRequest
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.guard import guarded
from rolloutgate.server.metrics import Metrics


@dataclass
class _Context:  # the part of GatewayContext the guard reads
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    active_requests: int = 0


async def _bad(request: web.Request) -> web.StreamResponse:
    raise BadRequest("'n' must be an integer", param="n", code="invalid_type")


async def _too_large(request: web.Request) -> web.StreamResponse:
    raise web.HTTPRequestEntityTooLarge(max_size=10, actual_size=20)


async def _malformed(request: web.Request) -> web.StreamResponse:
    raise ValueError("invalid header value")


async def _bug(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("a gateway bug")


async def _redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/elsewhere")


Served = tuple[httpx.AsyncClient, _Context, asyncio.Event, asyncio.Event]


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    ctx = _Context()
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        entered.set()
        await release.wait()
        return web.json_response({"active": ctx.active_requests})

    async def health(request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app[CONTEXT] = ctx  # type: ignore[misc]
    for path, handler in [
        ("/bad", _bad),
        ("/too-large", _too_large),
        ("/malformed", _malformed),
        ("/bug", _bug),
        ("/redirect", _redirect),
        ("/slow", slow),
        ("/health", health),
    ]:
        app.router.add_get(path, guarded(handler))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    async with httpx.AsyncClient(base_url=str(server.make_url("")), timeout=10) as http:
        yield http, ctx, entered, release
    await server.close()


async def test_errors_become_openai_json_with_their_status(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    http, ctx, _, _ = served
    bad = await http.get("/bad")
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_type"
    assert ctx.metrics.bad_requests.labels(code="invalid_type")._value.get() == 1
    too_large = await http.get("/too-large")
    assert too_large.status_code == 413 and too_large.json()["error"]["message"]
    malformed = await http.get("/malformed")
    assert malformed.status_code == 400 and "invalid header value" in malformed.json()["error"]["message"]
    with caplog.at_level(logging.ERROR, logger="rolloutgate"):
        bug = await http.get("/bug")
    assert bug.status_code == 500 and bug.json()["error"]["message"] == "internal gateway error"
    assert any(record.exc_info and "a gateway bug" in str(record.exc_info[1]) for record in caplog.records)
    redirect = await http.get("/redirect")  # not an error: aiohttp answers it as it is
    assert redirect.status_code == 302 and redirect.headers["Location"] == "/elsewhere"
    assert ctx.active_requests == 0


async def test_running_handlers_are_counted_and_draining_refuses_new_ones(served: Served) -> None:
    http, ctx, entered, release = served
    slow = asyncio.ensure_future(http.get("/slow"))
    await entered.wait()
    assert ctx.active_requests == 1
    ctx.draining = True
    refused = await http.get("/bad")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert (await http.get("/health")).status_code == 200  # answered while draining
    release.set()
    answer = await slow
    assert answer.json() == {"active": 1}
    assert ctx.active_requests == 0
