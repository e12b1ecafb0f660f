"""The weight-update gate (issue 5): an update in the middle of a run is a non-event for every client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until

# the simulated engines and the gateway run on the loop's time, at SCALE: on a fake-time loop a 90 s update
# passes when the loop is idle, with no real time spent waiting
pytestmark = pytest.mark.looptime

SCALE = 50.0
UPDATE_S = 90.0  # simulated seconds a weight update takes on each engine
TIMEOUT_S = 100.0  # charged budget: a request charged for the pause too (28 s decode + 90 s) would run out
TOKENS = 2_500  # ~28 simulated seconds of decode each


def chat(stream: bool) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "rollout"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": stream,
    }


def timing_of(response: httpx.Response, body: dict[str, Any] | None) -> dict[str, float]:
    if body is not None and "rolloutgate_timing" in body:
        return {
            k.removesuffix("_s"): v
            for k, v in body["rolloutgate_timing"].items()
            if isinstance(v, int | float)
        }
    header = response.headers["X-Rolloutgate-Timing"]
    return {k: float(v) for k, v in (part.split("=") for part in header.split(";"))}


async def one_request(http: httpx.AsyncClient, url: str, stream: bool) -> dict[str, float]:
    if not stream:
        response = await http.post(f"{url}/v1/chat/completions", json=chat(False))
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == TOKENS
        return {**timing_of(response, body), "weight_version": body["metadata"]["weight_version"]}
    timing = ""
    async with http.stream("POST", f"{url}/v1/chat/completions", json=chat(True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            assert '"error"' not in line, line
            if line.startswith(": rolloutgate-timing "):
                timing = line.removeprefix(": rolloutgate-timing ")
    return {k: float(v) for k, v in (part.split("=") for part in timing.split(";"))}


@pytest.mark.parametrize(
    ("mode", "stream", "staggered"),
    [
        ("drain", True, False),
        ("abort", False, False),
        ("in_place", True, False),
        ("retract", False, False),
        ("in_place", False, True),
    ],
)
async def test_an_update_in_the_middle_of_a_run_gives_no_timeout_and_no_client_error(
    make_cluster: MakeCluster, make_gateway: MakeGateway, mode: str, stream: bool, staggered: bool
) -> None:
    cluster = await make_cluster(
        engines=2, time_scale=SCALE, weight_update_s=UPDATE_S, max_running_requests=4
    )
    gateway = await make_gateway(cluster, timeout=TIMEOUT_S, capacity=4)
    async with httpx.AsyncClient(timeout=120) as http:
        first_wave = [asyncio.create_task(one_request(http, gateway.url, stream)) for _ in range(12)]
        await asyncio.sleep(10 / SCALE)  # the update lands while the first wave runs
        update = asyncio.create_task(
            http.post(
                f"{gateway.url}/admin/update_weights",
                json={
                    "path": "/update_weights_from_disk",
                    "body": {"model_path": "/ckpt/step-2", "weight_version": "step-2"},
                    "mode": mode,
                    "staggered": staggered,
                },
            )
        )
        serving = await watch_serving(cluster, update) if staggered else []
        await asyncio.sleep(0)
        during = [asyncio.create_task(one_request(http, gateway.url, stream)) for _ in range(4)]
        report = (await update).json()
        timings = await asyncio.gather(*first_wave, *during)  # every request completes: no error raised
    if not stream:  # each answer records the weight version that produced it
        assert [t["weight_version"] for t in timings[-len(during) :]] == ["step-2"] * len(during)
    assert report["ok"], report
    assert [e["ok"] for e in report["engines"]] == [True, True]
    assert [cluster.engines[i].weight_version for i in range(2)] == ["step-2", "step-2"]
    assert all(
        t["charged"] <= TIMEOUT_S < t["charged"] + UPDATE_S for t in timings if t["paused"] >= UPDATE_S
    )
    assert all(t["charged"] <= TIMEOUT_S for t in timings)
    assert any(t["paused"] > 0 for t in timings), timings  # the pause shows in the breakdowns, uncharged
    if staggered:
        assert serving and all(serving), "at every sample during a staggered update one engine served"


async def test_external_mode_holds_the_queue_while_the_trainer_pauses_the_engines_itself(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """miles' trainer, told to say so: `/admin/pause {"mode": "external"}`, then its own pause, update and
    continue on each engine, then `/admin/resume`. The gateway calls no engine, holds new work in its queue,
    and charges nobody meanwhile."""
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=UPDATE_S)
    gateway = await make_gateway(cluster, timeout=TIMEOUT_S)
    engine = cluster.engines[0]
    async with httpx.AsyncClient(timeout=120) as http:
        running = asyncio.create_task(one_request(http, gateway.url, False))
        await wait_until(lambda: any(r.completion_tokens > 100 for r in engine.model.requests()))
        closed = await http.post(f"{gateway.url}/admin/pause", json={"mode": "external"})
        assert closed.status_code == 200 and closed.json()["mode"] == "external"
        assert not engine.state(include_requests=False)["paused"]  # the gateway sent the engine nothing
        waiting = asyncio.create_task(one_request(http, gateway.url, False))
        assert (await http.post(f"{engine.url}/pause_generation", json={"mode": "retract"})).is_success
        updated = await http.post(
            f"{engine.url}/update_weights_from_disk",
            json={"model_path": "/ckpt/step-2", "weight_version": "step-2"},
        )
        assert updated.is_success, updated.text
        assert (await http.get(f"{gateway.url}/admin/state")).json()["queue_depth"] == 1  # held
        assert (await http.post(f"{engine.url}/continue_generation", json={})).is_success
        assert (await http.post(f"{gateway.url}/admin/resume", json={"weights_updated": True})).is_success
        first, second = await asyncio.gather(running, waiting)
    assert first["paused"] >= UPDATE_S and first["charged"] <= TIMEOUT_S, first
    assert second["weight_version"] == "step-2" and second["paused"] >= UPDATE_S, second
    refused = await gateway_update_in_external_mode(gateway.url)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"


async def gateway_update_in_external_mode(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"{url}/admin/update_weights", json={"path": "/update_weights_from_disk", "mode": "external"}
        )


async def watch_serving(cluster: Any, update: asyncio.Task[httpx.Response]) -> list[bool]:
    """Sample, every simulated second while the update runs, whether some engine is neither paused nor updating."""
    samples = []
    while not update.done():
        states = [e.state(include_requests=False) for e in cluster.engines]
        samples.append(any(not s["paused"] and not s["updating_weights"] for s in states))
        await asyncio.sleep(1 / SCALE)
    return samples


async def test_admin_endpoints_refuse_requests_without_the_token(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1), admin_token="s3cret")
    async with httpx.AsyncClient(timeout=30) as http:
        for method, path in [
            ("POST", "/admin/pause"),
            ("POST", "/admin/resume"),
            ("GET", "/admin/state"),
            ("POST", "/admin/update_weights"),
            ("GET", "/workers"),
            ("POST", "/workers"),
            ("DELETE", "/workers/engine-0"),
            ("POST", "/add_worker?url=http://127.0.0.1:1"),
            ("GET", "/list_workers"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = await http.request(method, gateway.url + path, headers=headers, json={})
                assert response.status_code == 401, (method, path, response.text)
                assert response.json()["error"]["code"] == "invalid_admin_token"
        ok = await http.get(f"{gateway.url}/admin/state", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert ok.json()["gate"]["open"] is True


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_abort_mode_continues_a_stream_from_the_tokens_already_sent(
    make_cluster: MakeCluster, make_gateway: MakeGateway, route: str
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=UPDATE_S)
    gateway = await make_gateway(cluster, timeout=TIMEOUT_S)
    if route == "chat":
        path, body = "/v1/chat/completions", chat(True)
    else:
        path = "/generate"
        body = {
            "input_ids": [5, 6, 7, 8],
            "stream": True,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True},
        }
    async with httpx.AsyncClient(timeout=120) as http:
        update = None
        pieces, last_chunk = 0, None
        async with http.stream("POST", gateway.url + path, json=body) as response:
            async for line in response.aiter_lines():
                assert '"error"' not in line, line
                if line.startswith(": rolloutgate-timing "):
                    timing = dict(part.split("=") for part in line.split(" ")[-1].split(";"))
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if route == "chat":
                    pieces += bool(chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
                else:
                    assert (
                        last_chunk is None
                        or chunk["output_ids"][: len(last_chunk["output_ids"])] == last_chunk["output_ids"]
                    )
                    last_chunk = chunk
                if (
                    update is None
                    and (pieces or last_chunk)
                    and (pieces > 200 or (last_chunk and len(last_chunk["output_ids"]) > 200))
                ):
                    update = asyncio.create_task(
                        http.post(
                            f"{gateway.url}/admin/update_weights",
                            json={"body": {"model_path": "x"}, "mode": "abort"},
                        )
                    )
        assert update is not None and (await update).json()["ok"]
    assert (
        int(timing["attempts"]) == 2 and float(timing["paused"]) >= UPDATE_S
    )  # aborted, re-run after resume
    if route == "chat":
        assert pieces == TOKENS
    else:
        assert last_chunk is not None
        assert len(last_chunk["output_ids"]) == last_chunk["meta_info"]["completion_tokens"] == TOKENS
