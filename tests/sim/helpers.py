"""Small HTTP helpers for simulator tests."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from rolloutgate.sim import SimEngine


async def post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any
) -> tuple[int, Any]:
    async with session.post(url, json=body, **kw) as response:
        raw = await response.read()
        return response.status, orjson.loads(raw) if raw.strip() else None


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """All `data:` payloads of an SSE response, parsed (the `[DONE]` sentinel kept as a string)."""
    events: list[Any] = []
    async for line in response.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            payload = text[len("data: ") :]
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def wait_for(predicate: Any, *, timeout_s: float = 10.0, every_s: float = 0.005) -> None:
    """Poll `predicate()` until true (bounded): engine state has no event to wait on from outside."""
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(every_s)


async def wait_running(engine: SimEngine, count: int = 1) -> None:
    await wait_for(lambda: engine.running_count >= count)
