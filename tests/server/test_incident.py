"""The incident's request A through the gateway, time-scaled on the simulator (DESIGN.md).

A decodes ~460 s on its own (~32K tokens at ~70 tok/s, with logprobs, as miles asks) while five other
sessions arrive with 100K-token histories; each prefill takes ~35 s and A gets only a trickle meanwhile, so
A's wall time passes 600 s. Engine-clock mode does not charge that contention and A completes; `--clock
wallclock` (the incident's proxy) times it out at 600 s.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rolloutsim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import (
    A_TOKENS,
    final_timing,
    gateway_error,
    generate_body,
    quarantines,
    run_request_a,
)
from tests.sim.helpers import wait_until

# the simulated engines and the gateway run on the loop's time, at SCALE: on a fake-time loop their minutes
# pass when the loop is idle, with no real time spent waiting
pytestmark = pytest.mark.looptime

SCALE = 50.0


@pytest.mark.parametrize("clock", ["engine", "wallclock"])
async def test_request_a_completes_in_engine_mode_and_times_out_in_wallclock_mode(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, clock: str
) -> None:
    """Request A as miles sends it (TITO `/generate` with `return_logprob`), at x100 in-process. The same with
    the default stall timeout, in processes at x20 and x100: tests/reliability/test_users_path.py."""
    cluster = await make_cluster(engines=1, profile="incident", time_scale=100.0)
    gateway = await make_gateway(cluster, clock=clock, timeout=600)
    response, storms = await run_request_a(http, gateway.url, scale=100.0)
    assert [s.status_code for s in storms] == [200] * 5
    if clock == "engine":
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["meta_info"]["completion_tokens"] == A_TOKENS
        assert len(answer["meta_info"]["output_token_logprobs"]) == A_TOKENS
        timing = final_timing(response)
        assert timing["wall"] > 600, timing  # it would have died under a submission-time timeout
        assert timing["charged"] < 600, timing
        assert timing["contention"] > 100, timing  # five ~35 s prefills of other sessions
    else:
        status, error = gateway_error(response)
        assert (status, error["code"]) == (504, "timeout"), error


async def test_a_70k_token_decode_ends_on_its_budget(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, profile="incident", time_scale=100.0)
    gateway = await make_gateway(cluster, timeout=600)
    response = await http.post(f"{gateway.url}/generate", json=generate_body(2_000, 70_000), timeout=None)
    status, error = gateway_error(response)
    assert (status, error["code"]) == (504, "timeout"), error
    assert error["rolloutgate_timing"]["charged_s"] >= 600
    assert await quarantines(http, gateway.url) == 0


async def test_requests_on_a_frozen_engine_finish_on_another(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=50.0)
    # Keep-alive off: headers committed early name the engine of that moment (respond.py), so a host stall that
    # stretches a call past keepalive_interval before it moves would report the frozen engine (CI, 2026-12-02)
    gateway = await make_gateway(cluster, stall_timeout=5.0, capacity=4, keepalive_interval=0)
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
    await wait_until(lambda: frozen.running_count > 0, "a request started on the engine to freeze")
    frozen.set_fault(Fault(kind="freeze"))
    responses = await asyncio.gather(*tasks)
    assert [r.status_code for r in responses] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in responses)
    assert {r.headers["X-Rolloutgate-Engine"] for r in responses} == {cluster.urls[1]}
    moved = [final_timing(r) for r in responses]
    assert any(t["attempts"] == 2 for t in moved)
