"""Load: 10,000 requests queued in the gateway and 1,000 in flight on simulated engines, held for a sustained
period, with no error and bounded memory.

Three processes, as in production: `rolloutgate sim` (4 engines x 250 running requests = 1,000 in flight),
`rolloutgate serve` in front of them, and a closed-loop load generator (tests/reliability/loadgen.py) that
keeps 11,100 requests outstanding, each client re-sending as soon as its answer arrives. The gate is closed
while the clients connect (so the queue fills at once instead of racing the engines), then opened: from then
on 1,000 run and ~10,100 wait, for RG_LOAD_SECONDS (default 60); then the clients stop sending and every
outstanding request is awaited. The test samples the gateway's own view (`/admin/state`) and its RSS every
second. Every answer must be a whole completion: one error fails the test.

The engines are slowed so the pool turns over ~200 requests a second: what the three processes sustain
together on two CPU cores (~4 ms of CPU per request, end to end). A queued request waits ~50 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import ROOT, Proc, add_figure, rss_bytes, spawn_gateway, spawn_sim

pytestmark = pytest.mark.reliability

ENGINES = 4
RUNNING_PER_ENGINE = 250  # 1,000 in flight
IN_FLIGHT = ENGINES * RUNNING_PER_ENGINE
SECONDS = float(os.environ.get("RG_LOAD_SECONDS", "60"))
CLIENTS = int(os.environ.get("RG_LOAD_CLIENTS", str(IN_FLIGHT + 10_100)))
MAX_TOKENS = 16
MIB = 1024 * 1024


async def admin_state(http: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        return (await http.get(f"{url}/admin/state")).json()  # type: ignore[no-any-return]
    except httpx.HTTPError:
        return None


@pytest.mark.timeout(SECONDS + 600)
async def test_ten_thousand_queued_and_a_thousand_in_flight_held_without_error(
    procs: list[Proc], tmp_path: Path
) -> None:
    # decode step = 62 ms + 1 ms per running request: ~312 ms with 250 running, so a 16-token answer takes
    # ~5 s on the engine and 1,000 in flight turn over ~200 requests a second.
    sim = spawn_sim(
        ENGINES,
        [
            *("--profile", "default", "--max-running-requests", str(RUNNING_PER_ENGINE)),
            *("--decode-base-ms", "62", "--decode-per-request-ms", "1.0", "--time-scale", "1"),
        ],
        tmp_path / "sim.log",
    )
    procs.append(sim)
    engine_flags = [flag for url in sim.urls for flag in ("--engine", f"sglang+{url}")]
    gateway = spawn_gateway(
        [*engine_flags, "--log-level", "warning"],
        tmp_path / "gateway.log",
    )
    procs.append(gateway)
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(f"{gateway.url}/admin/pause", json={"mode": "drain"})).status_code == 200
        loadgen = subprocess.Popen(  # noqa: ASYNC220 (started once; its output is read at the end)
            [
                *(sys.executable, "-m", "tests.reliability.loadgen", "--url", gateway.url),
                *("--clients", str(CLIENTS), "--max-tokens", str(MAX_TOKENS)),
                *("--seconds", str(SECONDS + 300), "--ramp-per-s", "1000"),
            ],
            stdout=subprocess.PIPE,
            stderr=(tmp_path / "loadgen.err").open("wb"),
            cwd=ROOT,
        )
        procs.append(Proc(popen=loadgen, log_path=tmp_path / "loadgen.err"))  # killed at teardown if left
        ramp_started = time.monotonic()
        while True:  # every client connected and queued behind the closed gate
            state = await admin_state(http, gateway.url)
            if state is not None and state["queue_depth"] >= CLIENTS:
                break
            assert loadgen.poll() is None, (tmp_path / "loadgen.err").read_text()
            assert time.monotonic() - ramp_started < 120, f"clients did not connect: {state}"
            await asyncio.sleep(0.5)
        ramp_s = time.monotonic() - ramp_started
        assert (await http.post(f"{gateway.url}/admin/resume")).status_code == 200
        window_started = time.monotonic()
        while time.monotonic() - window_started < SECONDS:
            state = await admin_state(http, gateway.url)
            if state is not None:
                samples.append(
                    {
                        "t": round(time.monotonic() - window_started, 2),
                        "queued": state["queue_depth"],
                        "in_flight": sum(state["in_flight"].values()),
                        "rss": rss_bytes(gateway.pid),
                    }
                )
            await asyncio.sleep(1.0)
        loadgen.send_signal(signal.SIGUSR1)  # stop sending; the outstanding requests are still answered
        drain_started = time.monotonic()
        out, _ = await asyncio.to_thread(loadgen.communicate)
        drain_s = time.monotonic() - drain_started
        idle = await admin_state(http, gateway.url)
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert gateway.is_alive(), gateway.log()[-3000:]

    in_flight = [s["in_flight"] for s in samples]
    queued = [s["queued"] for s in samples]
    rss = [s["rss"] for s in samples]
    half = len(rss) // 2
    figure = {
        "clients": CLIENTS,
        "ramp_s": round(ramp_s, 1),
        "held_s": samples[-1]["t"],
        "in_flight_median": statistics.median(in_flight),
        "in_flight_min": min(in_flight),
        "queued_median": statistics.median(queued),
        "queued_min": min(queued),
        "drain_s": round(drain_s, 1),
        "requests_answered": summary["good"],
        "errors": summary["error_count"],
        "error_examples": summary["error_examples"],
        "answers_per_s_while_held": round(summary["good"] / (SECONDS + drain_s), 1),
        "latency_p50_s": summary["latency_p50_s"],
        "latency_p99_s": summary["latency_p99_s"],
        "rss_first_half_max_mib": round(max(rss[:half]) / MIB, 1),
        "rss_second_half_max_mib": round(max(rss[half:]) / MIB, 1),
        "rss_every_10s_mib": [round(r / MIB) for r in rss[::10]],
    }
    add_figure("load", figure)
    assert summary["error_count"] == 0, figure
    assert summary["good"] == summary["sent"], figure
    assert samples[-1]["t"] >= 0.9 * SECONDS, figure
    assert statistics.median(in_flight) == IN_FLIGHT, figure
    assert statistics.median(queued) >= 10_000, figure
    assert idle is not None and idle["queue_depth"] == 0 and not any(idle["in_flight"].values()), idle
    # Bounded memory: in the second half of the window the gateway never goes past the first half's peak by
    # more than allocator noise, while thousands of requests go through it.
    assert max(rss[half:]) <= max(rss[:half]) * 1.05 + 16 * MIB, figure
