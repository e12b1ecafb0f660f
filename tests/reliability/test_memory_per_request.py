"""Memory in proportion to the wire: an in-flight request costs the gateway at most 1.5x its request body.

Two processes, as in production: `rolloutgate sim` (one SGLang engine that takes every request at once, prefills
instantly and then decodes one token a second) and `rolloutgate serve` in front of it. The test sends 50
non-streaming `/generate` requests at once, each with a prompt of 100K random token ids (~0.63 MB of JSON),
waits until all are in flight and the engine holds them (it read every body), and compares the growth of the
gateway's RSS (VmRSS, from before the first of them to the most of 2 s while all are in flight) with the sum of
their bodies.

Where the memory goes, per request (measured, 50 x 100K ids; figures are RSS growth / wire bytes):
- the exchange keeps the body for retries; the front keeps a prompt given as token ids as its compact JSON
  (`orjson.Fragment`, server/front.py `compact_body`), ~1x the wire, not as a list of Python ints (~5.6x:
  an 8-byte list slot and a 28-byte int per id). Before: 7.6x;
- the bytes of the upstream POST, another ~1x while the generation runs, as long as the lean pool's frames
  hold them (engines/upstream.py `_Post.__aenter__`'s `request` and upstream_wire.py `send`'s parameter live
  across the awaited push): 2.5x with them, ~1.45x without;
- glibc keeps what the bursts freed (the bodies being read, the POSTs waiting for the engine to read them):
  orjson's output buffers are over-allocated mmaps (16.6 MB for 0.63 MB of ids), and freeing one raises
  glibc's dynamic mmap threshold to that size and its trim threshold to twice it, so later big buffers come
  from the heap and stay resident once freed. With a fixed threshold (`MALLOC_MMAP_THRESHOLD_=131072`, or
  `mallopt(M_MMAP_THRESHOLD, ...)` at start-up) and the POST bytes dropped: ~1.16x.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.reliability.conftest import Proc, add_figure, rss_bytes, spawn_gateway, spawn_sim

pytestmark = pytest.mark.reliability

REQUESTS = 50
PROMPT_IDS = 100_000
MIB = 1024 * 1024


def prompt_body(seed: int) -> bytes:
    rng = random.Random(seed)
    ids = [rng.randrange(150_000) for _ in range(PROMPT_IDS)]
    return orjson.dumps(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 10_000, "ignore_eos": True}, "stream": False}
    )


async def engine_requests(http: httpx.AsyncClient, url: str) -> int:
    """Requests the simulated engine holds (it has read and parsed their bodies)."""
    try:
        return int((await http.get(f"{url}/get_load")).json()[0]["num_reqs"])
    except httpx.HTTPError:
        return -1


async def in_flight(http: httpx.AsyncClient, url: str) -> int:
    try:
        state = (await http.get(f"{url}/admin/state")).json()
    except httpx.HTTPError:
        return -1
    return int(sum(state["in_flight"].values()))


@pytest.mark.timeout(180)
async def test_in_flight_prompts_cost_at_most_one_and_a_half_times_their_bodies(
    procs: list[Proc], tmp_path: Path
) -> None:
    sim = spawn_sim(
        1,
        [
            *("--max-running-requests", str(REQUESTS + 14), "--chunked-prefill-size", "10000000"),
            *("--prefill-rate", "1e12", "--kv-capacity", "20000000", "--context-len", "1000000"),
            *("--decode-base-ms", "1000", "--decode-per-request-ms", "0", "--decode-per-ktoken-ms", "0"),
            *("--time-scale", "1", "--no-prefix-cache"),
        ],
        tmp_path / "sim.log",
    )
    procs.append(sim)
    gateway = spawn_gateway(
        [
            *("--engine", f"sglang+{sim.url}", "--capacity", str(REQUESTS + 14)),
            *("--prefill-budget-tokens", "off", "--prefill-rest-ratio", "0", "--log-level", "warning"),
        ],
        tmp_path / "gateway.log",
    )
    procs.append(gateway)
    bodies = [prompt_body(seed) for seed in range(REQUESTS)]
    wire = sum(len(body) for body in bodies)
    limits = httpx.Limits(max_connections=REQUESTS + 8, max_keepalive_connections=REQUESTS + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        warm = await http.post(
            f"{gateway.url}/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
        )
        assert warm.status_code == 200, warm.text
        await asyncio.sleep(0.5)
        before = rss_bytes(gateway.pid)
        tasks = [
            asyncio.create_task(
                http.post(
                    f"{gateway.url}/generate", content=body, headers={"Content-Type": "application/json"}
                )
            )
            for body in bodies
        ]
        del bodies
        try:
            deadline = time.monotonic() + 60
            ramp_peak = before
            while (running := await in_flight(http, gateway.url)) < REQUESTS or (
                await engine_requests(http, sim.url)
            ) < REQUESTS:  # in flight in the gateway, and every body read by the engine
                ramp_peak = max(ramp_peak, rss_bytes(gateway.pid))
                done = [t for t in tasks if t.done()]
                assert not done, f"a request ended early: {done[0].result().text[:500]}"
                assert time.monotonic() < deadline, f"only {running} of {REQUESTS} in flight"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            samples = []
            for _ in range(10):  # held for 2 s: the most while every request is in flight
                samples.append(rss_bytes(gateway.pid))
                await asyncio.sleep(0.2)
            assert await in_flight(http, gateway.url) == REQUESTS
            assert not any(t.done() for t in tasks)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
    growth = max(samples) - before
    figure = {
        "requests": REQUESTS,
        "prompt_ids": PROMPT_IDS,
        "wire_mib": round(wire / MIB, 1),
        "rss_before_mib": round(before / MIB, 1),
        "rss_growth_mib": round(growth / MIB, 1),
        "rss_ramp_peak_growth_mib": round((max(ramp_peak, *samples) - before) / MIB, 1),
        "growth_per_body": round(growth / wire, 2),
    }
    add_figure("memory_per_in_flight_request", figure)
    assert gateway.is_alive(), gateway.log()[-3000:]
    assert growth <= 1.5 * wire, figure
