"""A wire tap in front of one engine: every `/generate` and chat body the engine received and the last answer
chunk it sent, so tests compare what the gateway recorded with the engine's own ids, token for token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

_SKIPPED = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})


_TAPPED = frozenset({"/generate", "/v1/chat/completions", "/v1/completions"})


@dataclass
class TappedCall:
    path: str
    body: dict[str, Any]
    answer: dict[str, Any] | None = None  # the last JSON value the engine sent (a stream's last chunk)

    @property
    def meta_info(self) -> dict[str, Any]:
        """The engine's meta_info (`/generate`'s, or the chat answer's first choice's)."""
        assert self.answer is not None
        if "choices" in self.answer:
            meta: dict[str, Any] = self.answer["choices"][0]["meta_info"]
            return meta
        top: dict[str, Any] = self.answer["meta_info"]
        return top

    @property
    def output_ids(self) -> list[int]:
        return [t[1] for t in self.meta_info["output_token_logprobs"]]

    @property
    def output_logprobs(self) -> list[float]:
        return [t[0] for t in self.meta_info["output_token_logprobs"]]


@dataclass
class EngineTap:
    upstream: str
    calls: list[TappedCall] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> EngineTap:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._session = aiohttp.ClientSession()
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def generations(self) -> list[TappedCall]:
        """The calls that carried prompt ids (not the gateway's health probes)."""
        return [c for c in self.calls if c.body.get("input_ids") and c.answer is not None]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        raw = await request.read()
        call: TappedCall | None = None
        if request.path in _TAPPED and raw:
            call = TappedCall(path=request.path, body=orjson.loads(raw))
            self.calls.append(call)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIPPED | {"host"}}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=raw or None, headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _SKIPPED},
            )
            tail = b""
            try:
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                    if call is not None:
                        tail = (tail + chunk)[-8 * 1024 * 1024 :]
                await response.write_eof()
            except ConnectionResetError:  # the gateway closed the call (it had the answer, or gave up)
                pass
        if call is not None:
            call.answer = _last_json(tail)
        return response


def _last_json(data: bytes) -> dict[str, Any] | None:
    """A whole JSON body, or the last `data: {...}` event of an SSE stream."""
    text = data.strip()
    if text.startswith(b"{"):
        value = orjson.loads(text)
        return value if isinstance(value, dict) else None
    events = [line[len(b"data: ") :] for line in text.split(b"\n") if line.startswith(b"data: {")]
    return orjson.loads(events[-1]) if events else None
