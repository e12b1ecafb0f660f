"""`/admin/state`'s engines, as `rolloutgate top` reads them (server/admin.py `state`, server/pool.py
`describe_live`): load, long prefills, pauses and liveness, each read from the core at the moment of the call;
and the engine time wasted on requests that failed (`rolloutgate_wasted_engine_seconds_total`)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest

from rolloutsim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until

# the simulated engines and the gateway run on the loop's time, at SCALE (looptime: no real time waited)
pytestmark = pytest.mark.looptime

SCALE = 50.0
STALL_TIMEOUT = 30.0


def chat(max_tokens: int, content: str = "go", **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def engines_of(http: httpx.AsyncClient, url: str) -> dict[str, dict[str, Any]]:
    """/admin/state's engines by URL."""
    response = await http.get(f"{url}/admin/state")
    assert response.status_code == 200, response.text
    return {e["url"]: e for e in response.json()["engines"]}


async def test_an_engine_with_work_shows_its_load_and_how_long_it_has_been_silent(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, stall_timeout=STALL_TIMEOUT, capacity=4)
    task = asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=chat(2_000, stream=True)))
    await wait_until(lambda: sum(e.running_count for e in cluster.engines) == 1, "the request running")
    busy_url, idle_url = sorted(
        cluster.urls, key=lambda u: -cluster.engines[cluster.urls.index(u)].running_count
    )
    engines = await engines_of(http, gateway.url)
    busy = engines[busy_url]
    assert (busy["running"], busy["queued"], busy["prefilling"]) == (1, 0, False)
    assert (busy["quarantined"], busy["paused_by_gate"], busy["paused_by_engine"]) == (False, False, False)
    assert busy["hung_after_s"] == STALL_TIMEOUT  # no long prefill: no allowance
    assert isinstance(busy["silent_s"], float) and 0 <= busy["silent_s"] < STALL_TIMEOUT
    assert engines[idle_url]["running"] == 0 and engines[idle_url]["silent_s"] is None  # no work: not judged
    assert (await task).status_code == 200
    after = (await engines_of(http, gateway.url))[busy_url]
    assert after["generated_tokens"] == 2_000 and after["silent_s"] is None and after["running"] == 0


async def test_a_frozen_engine_grows_silent_then_is_quarantined(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, stall_timeout=STALL_TIMEOUT, keepalive_interval=0)
    frozen = cluster.engines[0]
    tasks = [
        asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=chat(3_000, stream=True)))
        for _ in range(4)
    ]
    await wait_until(lambda: frozen.running_count > 0, "a request on the engine to freeze")
    frozen.set_fault(Fault(kind="freeze"))
    silences: list[float] = []

    async def silent_for_half_the_window() -> bool:
        engine = (await engines_of(http, gateway.url))[frozen.url]
        if engine["silent_s"] is not None:
            silences.append(engine["silent_s"])
        return engine["silent_s"] is not None and engine["silent_s"] >= STALL_TIMEOUT / 2

    await wait_until(silent_for_half_the_window, "the frozen engine silent for half its window", every_s=0.05)
    assert silences == sorted(silences)  # its silence only grows
    assert not (await engines_of(http, gateway.url))[frozen.url]["quarantined"]

    async def quarantined() -> bool:
        return bool((await engines_of(http, gateway.url))[frozen.url]["quarantined"])

    await wait_until(quarantined, "the frozen engine quarantined", every_s=0.05)
    engine = (await engines_of(http, gateway.url))[frozen.url]
    assert (engine["state"], engine["running"], engine["silent_s"]) == ("quarantined", 0, None)  # work moved
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4


async def test_a_long_prefill_in_progress_shows_and_widens_the_window(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, stall_timeout=STALL_TIMEOUT)
    long_prompt = " ".join(f"w{i}" for i in range(20_000))  # well past contention_min_prefill_tokens
    task = asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=chat(10, long_prompt)))

    async def prefilling() -> bool:
        return bool((await engines_of(http, gateway.url))[cluster.urls[0]]["prefilling"])

    await wait_until(prefilling, "the long prefill shown", every_s=0.01)
    engine = (await engines_of(http, gateway.url))[cluster.urls[0]]
    assert engine["hung_after_s"] > STALL_TIMEOUT  # the prefill allowance (core/liveness.py)
    assert (await task).status_code == 200
    assert not (await engines_of(http, gateway.url))[cluster.urls[0]]["prefilling"]


async def test_a_closed_gate_pauses_every_engine_by_the_gate(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    assert (await http.post(f"{gateway.url}/admin/pause", json={"mode": "drain"})).status_code == 200
    engines = await engines_of(http, gateway.url)
    assert [(e["paused_by_gate"], e["paused_by_engine"]) for e in engines.values()] == [(True, False)] * 2
    assert (await http.post(f"{gateway.url}/admin/resume")).status_code == 200
    assert not any(e["paused_by_gate"] for e in (await engines_of(http, gateway.url)).values())


async def test_the_engine_time_of_a_request_that_timed_out_is_counted_wasted(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, timeout=5.0)
    ok = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(10))
    assert ok.status_code == 200
    failed = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(5_000))  # ~55 s of decode
    assert failed.status_code == 504, failed.text
    charged_s = failed.json()["error"]["rolloutgate_timing"]["charged_s"]
    metrics = (await http.get(f"{gateway.url}/metrics")).text
    wasted = re.findall(r'^rolloutgate_wasted_engine_seconds_total\{reason="(\w+)"\} (\S+)$', metrics, re.M)
    assert [(reason, float(value)) for reason, value in wasted] == [
        ("timeout", pytest.approx(charged_s, abs=1e-3))
    ]
