"""Small HTTP helpers for simulator tests."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from rolloutsim import SimEngine


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


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]],
    what: str = "",
    *,
    timeout_s: float = 10.0,
    every_s: float = 0.005,
) -> None:
    """Poll `predicate()` (sync, or async for a state read over HTTP) until true, bounded by `timeout_s` seconds
    of the loop's time: what it waits on (engine or gateway state) has no event to wait on from outside. On a
    fake-time loop (`@pytest.mark.looptime`) the polls cost no real time and the bound is fake seconds too."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                result = predicate()
                if inspect.isawaitable(result):
                    result = await result
                if result:
                    return
                await asyncio.sleep(every_s)
    except TimeoutError:
        raise AssertionError(f"{what or predicate}: not reached in {timeout_s} s") from None


async def wait_running(engine: SimEngine, count: int = 1) -> None:
    await wait_until(lambda: engine.running_count >= count)
