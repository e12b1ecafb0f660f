"""The RL shape's clients: every worker's turns at once against one URL each (a closed loop, one call in flight
per worker), as miles' non-streaming client sends them (aiohttp, no timeout), and what they hold in flight."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import orjson

from benchmarks.perf.rl_shape.phase import TurnResult
from benchmarks.perf.rl_shape.plan import (
    ROUTING_HEADER,
    Turn,
    output_ids,
    request_body,
    session_prefix,
    turn_new_ids,
)

__all__ = ("InFlight", "drive")


class InFlight:
    """What the clients have sent and not yet read back (read by the sampler thread)."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size

    def remove(self, size: int) -> None:
        self.count -= 1
        self.bytes -= size


async def drive(
    plan: list[list[Turn]],
    url_of: Callable[[Turn], str],
    *,
    cap_s: float,
    tracker: InFlight,
    ramp_s: float = 0.0,
) -> tuple[list[TurnResult], bool, float]:
    """Run every worker's turns at once (closed loop, one call in flight per worker). Returns the results in
    plan order, whether the phase hit its cap, and its wall time (first call to last answer)."""
    results: dict[tuple[int, int], TurnResult] = {}
    connector = aiohttp.TCPConnector(limit=len(plan) + 8, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_read=None, sock_connect=None)
    began = time.perf_counter()

    async def worker(session: aiohttp.ClientSession, turns: list[Turn], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        ids: list[int] | None = None
        output: list[int] = []
        for turn in turns:
            if turn.turn_in_session == 0:
                ids, output = session_prefix(turn.session_number, turn.input_len), []
            elif ids is None:
                results[turn.key] = TurnResult(turn.worker, turn.index, -2)
                continue
            else:
                ids.extend(output)
                ids.extend(turn_new_ids(turn))
            body = orjson.dumps(request_body(ids, turn.max_new))
            result = TurnResult(turn.worker, turn.index, -1, body_bytes=len(body))
            results[turn.key] = result
            headers = {"Content-Type": "application/json", ROUTING_HEADER: turn.session}
            tracker.add(len(body))
            sent = time.perf_counter()
            try:
                async with session.post(url_of(turn), data=body, headers=headers) as response:
                    raw = await response.read()
                    status = response.status
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a transport error: the session cannot go on
                result.status, result.error = 0, f"{type(exc).__name__}: {exc}"[:200]
                ids = None
                continue
            finally:
                tracker.remove(len(body))
            result.latency_s = time.perf_counter() - sent
            result.status, result.response_bytes = status, len(raw)
            if status != 200:
                result.error = f"HTTP {status}: {raw[:160].decode(errors='replace')}"
                ids = None
                continue
            try:
                answer = orjson.loads(raw)
                meta = answer.get("meta_info") or {}
                output = output_ids(answer)
            except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError, KeyError) as exc:
                result.status, result.error = 0, f"unreadable answer: {exc}"[:200]
                ids = None
                continue
            result.completion_tokens = int(meta.get("completion_tokens") or len(output))
            result.cached_tokens = int(meta.get("cached_tokens") or 0)
            result.prompt_tokens = int(meta.get("prompt_tokens") or 0)
            if len(output) != turn.max_new:  # the plan's lengths no longer hold for this session
                result.error = f"{len(output)} output ids for max_new_tokens {turn.max_new}"

    cut = False
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.ensure_future(worker(session, turns, ramp_s * w / len(plan)))
            for w, turns in enumerate(plan)
        ]
        done, pending = await asyncio.wait(tasks, timeout=cap_s)
        if pending:
            cut = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    wall = time.perf_counter() - began
    ordered = []
    for turns in plan:
        for turn in turns:
            ordered.append(results.get(turn.key) or TurnResult(turn.worker, turn.index, -1))
    return ordered, cut, wall
