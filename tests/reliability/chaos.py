"""A misbehaving engine for fault tests: a proxy in front of a simulated engine that breaks generations.

Everything but the generation routes passes through unchanged (so the gateway probes and health-checks a
real simulated engine); a generation is answered according to `mode`:

| mode          | what the gateway sees                                                              |
| ------------- | ---------------------------------------------------------------------------------- |
| pass          | the simulated engine's answer                                                      |
| reset         | the connection reset (RST) before any byte of an answer                            |
| reset_after   | a 200 stream, `after_events` events of it, then a connection reset mid-stream;     |
|               | a whole (non-streamed) answer: half of its body, then the reset                   |
| truncate      | a 200 stream, `after_events` events, then a clean end without `[DONE]`;            |
|               | a whole answer: half of its body, then a clean end                                 |
| garbage_sse   | a 200 event stream whose events are random bytes                                   |
| garbage_body  | a 200 `application/json` answer that is random bytes, not an event stream          |
| garbage_http  | random bytes where the HTTP status line belongs, then the connection closes        |
| bad_status    | an HTTP 500 with an HTML body                                                      |
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ("MODES", "ChaosEngine")

MODES = (
    "pass",
    "reset",
    "reset_after",
    "truncate",
    "garbage_sse",
    "garbage_body",
    "garbage_http",
    "bad_status",
)
GENERATION_PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})
_SKIP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class ChaosEngine:
    def __init__(
        self, upstream_url: str, *, mode: str = "pass", after_events: int = 3, seed: int = 0
    ) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.mode = mode
        self.after_events = after_events
        self.generations: Counter[str] = Counter()  # mode -> generation requests answered that way
        self._rng = random.Random(seed)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> ChaosEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _garbage(self, size: int) -> bytes:
        return bytes(self._rng.getrandbits(8) for _ in range(size))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path not in GENERATION_PATHS or self.mode == "pass":
            if request.path in GENERATION_PATHS:
                self.generations["pass"] += 1
            return await self._forward(request, body, cut_after=None)
        mode = self.mode
        self.generations[mode] += 1
        transport = request.transport
        assert transport is not None
        if mode == "reset":
            transport.abort()
            return await _never()
        if mode == "garbage_http":
            transport.write(self._garbage(512) + b"\r\n\r\n")
            transport.close()
            return await _never()
        if mode == "bad_status":
            return web.Response(status=500, body=b"<html><body>Internal Server Error</body></html>")
        if mode == "garbage_body":
            return web.Response(body=self._garbage(4096), content_type="application/json")
        if mode == "garbage_sse":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(5):
                await response.write(b"data: " + self._garbage(64).replace(b"\n", b" ") + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return await self._forward(request, body, cut_after=self.after_events)

    async def _forward(self, request: web.Request, body: bytes, cut_after: int | None) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_HEADERS}
        async with self._session.request(
            request.method, self.upstream_url + request.rel_url.path_qs, headers=headers, data=body or None
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP_HEADERS},
            )
            await response.prepare(request)
            if cut_after is not None and upstream.content_type != "text/event-stream":
                # a whole answer (the gateway's non-streaming calls): cut in half
                whole = await upstream.read()
                await response.write(whole[: len(whole) // 2])
                return await self._cut(request, response)
            events = 0
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                events += chunk.count(b"\n\n")
                if cut_after is not None and events >= cut_after:
                    return await self._cut(request, response)
            await response.write_eof()
            return response

    async def _cut(self, request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        if self.mode == "truncate":
            await response.write_eof()  # a well-formed chunked end: the stream just stops
            return response
        transport.abort()  # reset_after
        return await _never()


async def _never() -> Any:
    """Park a handler whose connection is gone until aiohttp cancels it."""
    await asyncio.sleep(3600)
