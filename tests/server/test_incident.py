"""The incident's request A through the gateway, time-scaled on the simulator (DESIGN.md).

A decodes ~460 s on its own (~32K tokens at ~70 tok/s) while five other sessions arrive with 100K-token
histories; each prefill takes ~35 s and A gets only a trickle meanwhile, so A's wall time passes 600 s.
Engine-clock mode does not charge that contention and A completes; `--clock wallclock` (the incident's
proxy) times it out at 600 s.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rolloutgate.sim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway

SCALE = 50.0
A_TOKENS = 32_000
STORM_PROMPT_TOKENS = 100_000


def parse_timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in (part.split("=") for part in header.split(";"))}


def final_timing(response: httpx.Response) -> dict[str, float]:
    """The final breakdown: in the body when keep-alive committed the headers early, else in the header."""
    in_body = response.json().get("rolloutgate_timing")
    if in_body is not None:
        return {k.removesuffix("_s"): v for k, v in in_body.items() if isinstance(v, int | float)}
    return parse_timing(response.headers["X-Rolloutgate-Timing"])


async def run_incident(http: httpx.AsyncClient, url: str) -> httpx.Response:
    a = asyncio.create_task(
        http.post(
            f"{url}/generate",
            json={
                "input_ids": list(range(1, 2001)),
                "sampling_params": {"max_new_tokens": A_TOKENS, "ignore_eos": True},
            },
        )
    )
    storms = []
    for i in range(5):
        await asyncio.sleep(90 / SCALE)  # a new long-history session every ~90 simulated seconds
        storms.append(
            asyncio.create_task(
                http.post(
                    f"{url}/generate",
                    json={
                        "input_ids": [7 + i] * STORM_PROMPT_TOKENS,
                        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                    },
                )
            )
        )
    response = await a
    for storm in storms:
        assert (await storm).status_code == 200
    return response


@pytest.mark.parametrize("clock", ["engine", "wallclock"])
async def test_request_a_completes_in_engine_mode_and_times_out_in_wallclock_mode(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, clock: str
) -> None:
    cluster = await make_cluster(engines=1, profile="incident", time_scale=SCALE)
    gateway = await make_gateway(
        cluster, clock=clock, timeout=600, stall_timeout=120, progress_every_tokens=16
    )
    response = await run_incident(http, gateway.url)
    if clock == "engine":
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == A_TOKENS
        timing = final_timing(response)
        assert timing["wall"] > 600, timing  # it would have died under a submission-time timeout
        assert timing["charged"] < 600, timing
        assert timing["contention"] > 100, timing  # five ~35 s prefills of other sessions
    else:
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"


async def test_requests_on_a_frozen_engine_finish_on_another(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=50.0)
    gateway = await make_gateway(cluster, stall_timeout=5.0, capacity=4)
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    tasks = [
        asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=body)) for _ in range(8)
    ]
    frozen = cluster.engines[0]
    for _ in range(2000):  # let work start on both engines (bounded: 10 s), then freeze one
        if frozen.running_count:
            break
        await asyncio.sleep(0.005)
    assert frozen.running_count, "no request started on the engine to freeze"
    frozen.set_fault(Fault(kind="freeze"))
    responses = await asyncio.gather(*tasks)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in responses)
    assert {r.headers["X-Rolloutgate-Engine"] for r in responses} == {cluster.urls[1]}
    moved = [final_timing(r) for r in responses]
    assert any(t["attempts"] == 2 for t in moved)
