"""SMG's RL control plane on rolloutgate (server/rl_plane.py), driven by SMG's own client: `smg.rl` from the
`smg` package (1.13), unchanged, against simulated SGLang engines.

The client is synchronous (urllib), so it runs in a worker thread while the loop serves the gateway and the
engines; the engines run on a time scale, so a pause of 40 engine seconds costs 0.4 s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest
from smg.rl import RL, FanoutError, RlError, paused

from rolloutsim import SimCluster
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import final_timing, generate_body, quarantines
from tests.sim.helpers import wait_until

SCALE = 100.0
TOKENS = 4_000  # decoding long enough to outlast the pause
PAUSE_S = 40.0  # engine seconds the fleet stays paused

T = TypeVar("T")


async def client_call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def decoding(cluster: SimCluster, tokens: int) -> None:
    models = [e.model for e in cluster.engines]
    await wait_until(lambda: any(r.completion_tokens >= tokens for m in models for r in m.requests()))


async def test_smg_client_pauses_updates_and_continues_a_fleet_while_a_long_logprob_call_runs(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Issue 34's first row: `paused(rl, "engine=sglang")` around a fan-out of `update_weights_from_disk`, a
    3-engine fleet, a 4,000-token logprob call decoding meanwhile. The call completes whole; its timing shows the
    pause as paused, none of it charged; every engine reports the new version, in discovery and in its answers;
    no engine is quarantined."""
    cluster = await make_cluster(engines=3, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    rl = RL(gateway.url, timeout=30.0)
    call = asyncio.create_task(
        http.post(f"{gateway.url}/generate", json=generate_body(500, TOKENS), timeout=None)
    )
    await decoding(cluster, 300)

    def refit() -> dict[str, int]:
        with paused(rl, "engine=sglang", mode="retract") as pause:
            assert pause.succeeded == 3 and not pause.failed
            time.sleep(PAUSE_S / SCALE)
            update = rl.fanout(
                "update_weights_from_disk",
                {"model_path": "/ckpt/step-7", "weight_version": "7"},
                selector="engine=sglang",
            )
        return {wid: r.status for wid, r in update.results.items()}

    statuses = await client_call(refit)
    assert sorted(statuses.values()) == [200, 200, 200]
    response = await call
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    assert meta["completion_tokens"] == TOKENS
    assert meta["weight_version"] == "7"  # it finished under the new weights
    timing = final_timing(response)
    print(f"smg.rl refit of 3 engines during a {TOKENS}-token call: {timing}")
    assert timing["paused"] >= PAUSE_S, timing  # the whole pause, told before the engines paused
    assert timing["charged"] <= timing["wall"] - PAUSE_S, timing
    workers = await client_call(rl.workers)
    assert [w.weight_version for w in workers] == ["7", "7", "7"]
    assert all(w.health == "ready" and w.labels["weight_version"] == "7" for w in workers)
    assert [w.capabilities["pause_modes"] for w in workers] == [["abort", "retract", "in_place"]] * 3
    assert await quarantines(http, gateway.url) == 0


async def test_a_call_to_one_engine_comes_back_in_smgs_envelope(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    rl = RL(gateway.url, timeout=30.0)
    workers = await client_call(rl.workers)
    assert [w.url for w in workers] == sorted(cluster.urls)
    info = await client_call(rl.call, workers[0].id, "server_info", method="GET")
    assert info.status == 200 and info.url == workers[0].url
    assert info.body["weight_version"] == "default"
    one = await client_call(rl.worker, workers[1].id)
    assert one.base_url == workers[1].url and one.connection_mode == "http"
    # an engine's own 4xx comes back in the envelope, with its status
    refused = await client_call(rl.call, workers[0].id, "pause_generation", {"mode": "sideways"})
    assert refused.status == 400
    state = await client_call(rl.worker, workers[0].id)
    assert state.health == "ready"  # the refused pause held nothing


async def test_fan_out_reports_each_engine_and_answers_207_when_one_failed(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    rl = RL(gateway.url, timeout=30.0)
    flushed = await client_call(rl.fanout, "flush_cache", selector="engine=sglang")
    assert flushed.total == flushed.succeeded == 2 and not flushed.failed
    await cluster.engines[1].stop()  # unreachable now
    with pytest.raises(FanoutError) as caught:
        await client_call(rl.fanout, "flush_cache", selector="engine in (sglang, vllm)")
    result = caught.value.result
    assert (result.total, result.succeeded) == (2, 1)
    assert [f.error for f in result.failed] == ["upstream_unreachable"]
    partial = await client_call(rl.fanout, "flush_cache", selector="health=ready", allow_partial=True)
    assert partial.total == 2 and len(partial.results) == 1


@pytest.mark.parametrize(
    ("route", "status", "code"),
    [
        ("/v1/rl/workers/engine-9/engine/pause_generation", 404, "worker_not_found"),
        ("/v1/rl/workers/engine-0/engine/pause_generation:now", 400, "invalid_engine_path"),
        ("/v1/rl/workers/engine-0/engine/a/b/c/d/pause_generation", 400, "invalid_engine_path"),
        ("/v1/rl/engine/pause_generation", 400, "selector_required"),
        ("/v1/rl/engine/pause_generation?selector=engine%3D%3Dsglang", 400, "invalid_selector"),
        ("/v1/rl/engine/pause_generation?selector=engine%3Dtrtllm", 400, "no_workers_match"),
    ],
)
async def test_bad_calls_get_smgs_errors_and_reach_no_engine(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    route: str,
    status: int,
    code: str,
) -> None:
    """Each bad call is answered by the gateway in SMG's error shape, which `smg.rl` raises as `RlError` with
    the code; the engine is never paused by it, and keeps serving through the gateway."""
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    response = await http.post(gateway.url + route, json={})
    assert response.status_code == status, response.text
    assert response.json()["error"] == code
    rl = RL(gateway.url, timeout=10.0)
    with pytest.raises(RlError) as caught:
        if route.startswith("/v1/rl/engine/"):
            selector = httpx.URL(gateway.url + route).params.get("selector") or ""
            await client_call(rl.fanout, "pause_generation", {}, selector=selector)
        else:
            worker_id, path = route.removeprefix("/v1/rl/workers/").split("/engine/", 1)
            await client_call(rl.call, worker_id, path, {})
    assert caught.value.code == code
    assert not cluster.engines[0].paused
    answer = await http.post(f"{gateway.url}/generate", json=generate_body(10, 5))
    assert answer.status_code == 200, answer.text


async def served_versions(http: httpx.AsyncClient, url: str, calls: int) -> list[str]:
    answers = await asyncio.gather(
        *(http.post(f"{url}/generate", json=generate_body(20, 30, first_id=1 + i)) for i in range(calls))
    )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return [a.json()["meta_info"]["weight_version"] for a in answers]


@pytest.mark.parametrize("policy", ["latest-only", "any"])
async def test_an_engine_left_on_old_weights_serves_nothing_under_latest_only(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, policy: str
) -> None:
    """Three engines; the update reaches two (engine-2's update did not happen: it holds the old weights, as
    one whose update failed does). Under latest-only no call is answered on the old weights, until engine-2
    is updated too; under `any` engine-2 goes on serving them."""
    cluster = await make_cluster(engines=3)
    gateway = await make_gateway(cluster, version_policy=policy)
    rl = RL(gateway.url, timeout=30.0)

    def partial_refit() -> None:
        with paused(rl, "id!=engine-2"):
            rl.fanout(
                "update_weights_from_disk",
                {"model_path": "/ckpt/7", "weight_version": "7"},
                selector="id!=engine-2",
            )

    await client_call(partial_refit)
    versions = await served_versions(http, gateway.url, 24)
    behind = {w.id: w for w in await client_call(rl.workers)}["engine-2"]
    if policy == "latest-only":
        assert set(versions) == {"7"}
        assert cluster.engines[2].model.stats.requests_total == 0
        assert behind.health == "ready" and behind.weight_version == "default"
        assert (await http.get(f"{gateway.url}/v1/rl/workers/engine-2")).json()["version_lag"] == 1
        # updated at last, it takes work again
        await client_call(
            rl.call, "engine-2", "update_weights_from_disk", {"model_path": "/ckpt/7", "weight_version": "7"}
        )
        assert (await http.get(f"{gateway.url}/v1/rl/workers/engine-2")).json()["version_lag"] == 0
        assert set(await served_versions(http, gateway.url, 24)) == {"7"}
        assert cluster.engines[2].model.stats.requests_total > 0
    else:
        assert set(versions) == {"7", "default"}


async def test_an_engine_that_rejoins_with_old_weights_waits_for_the_fleets_version(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Under latest-only, an engine registered again after a restart holding its checkpoint's weights takes
    no work until it holds the version the rest of the pool serves."""
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster, version_policy="latest-only")
    rl = RL(gateway.url, timeout=30.0)
    await client_call(rl.fanout, "update_weight_version", {"new_version": "3"}, selector="engine=sglang")
    assert set(await served_versions(http, gateway.url, 8)) == {"3"}
    old = cluster.engines[1]
    old.set_weight_version("default")  # as a restart from the checkpoint leaves it
    removed = await http.delete(f"{gateway.url}/workers/engine-1")
    assert removed.status_code in (200, 204), removed.text
    added = await http.post(f"{gateway.url}/workers", json={"url": old.url})
    assert added.status_code == 201, added.text
    rejoined = added.json()["id"]
    before = old.model.stats.requests_total
    assert set(await served_versions(http, gateway.url, 16)) == {"3"}
    assert old.model.stats.requests_total == before
    await client_call(rl.call, rejoined, "update_weight_version", {"new_version": "3"})
    assert set(await served_versions(http, gateway.url, 16)) == {"3"}
    assert old.model.stats.requests_total > before


async def test_an_engine_that_restarts_in_place_with_old_weights_waits_for_the_fleets_version(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """No re-registration: the engine's process restarts on its port holding its checkpoint's weights. Its
    health checks fail while it is down; once they pass again the gateway reads its version before it takes
    work, so under latest-only it serves nothing until it holds the pool's version."""
    cluster = await make_cluster(engines=2, time_scale=100.0)
    gateway = await make_gateway(cluster, version_policy="latest-only")
    rl = RL(gateway.url, timeout=30.0)
    await client_call(rl.fanout, "update_weight_version", {"new_version": "3"}, selector="engine=sglang")
    old = cluster.engines[1]
    old.set_fault("restart", down_s=30.0, duration_s=30.0)  # a few health checks long
    old.set_weight_version("default")  # as a restart from the checkpoint leaves it

    async def lag() -> int:
        return int((await http.get(f"{gateway.url}/v1/rl/workers/engine-1")).json()["version_lag"])

    async def lag_read() -> bool:
        return await lag() == 1

    await wait_until(lambda: not old.is_starting, "the engine back")
    await wait_until(lag_read, "the restarted engine's version read")
    before = old.model.stats.requests_total
    assert set(await served_versions(http, gateway.url, 16)) == {"3"}
    assert old.model.stats.requests_total == before
    await client_call(rl.call, "engine-1", "update_weight_version", {"new_version": "3"})
    assert await lag() == 0
    assert set(await served_versions(http, gateway.url, 16)) == {"3"}
    assert old.model.stats.requests_total > before


@pytest.mark.parametrize(
    ("policy", "served"),
    [
        ("latest-only", {"7"}),
        ("max-staleness:0", {"7"}),
        ("min-version:7", {"7"}),
        ("max-staleness:1", {"7", "default"}),
        ("min-version:default", {"7", "default"}),
        ("any", {"7", "default"}),
    ],
)
async def test_a_requests_own_version_policy_decides_where_it_may_start(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    policy: str,
    served: set[str],
) -> None:
    """SMG's `x-smg-version-policy` per request, over the gateway's default (any): engine-1 left on the old
    weights serves only the requests whose policy allows a lag of one version."""
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    rl = RL(gateway.url, timeout=30.0)
    await client_call(rl.call, "engine-0", "update_weight_version", {"new_version": "7"})
    answers = await asyncio.gather(
        *(
            http.post(
                f"{gateway.url}/generate",
                json=generate_body(20, 30, first_id=1 + i),
                headers={"x-smg-version-policy": policy},
            )
            for i in range(16)
        )
    )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert {a.json()["meta_info"]["weight_version"] for a in answers} == served


@pytest.mark.parametrize("policy", ["newest", "max-staleness:-1", "min-version:9"])
async def test_a_policy_that_does_not_parse_or_names_an_unseen_version_is_a_400(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, policy: str
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    bad = await http.post(
        f"{gateway.url}/generate", json=generate_body(20, 5), headers={"x-smg-version-policy": policy}
    )
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == "invalid_version_policy"
    good = await http.post(f"{gateway.url}/generate", json=generate_body(20, 5))
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(
    ("method", "route", "status", "code"),
    [
        ("GET", "/v1/rl/nowhere", 404, "not_found"),
        ("POST", "/v1/rl/workers", 405, "method_not_allowed"),
        ("DELETE", "/v1/rl/engine/flush_cache?selector=engine%3Dsglang", 405, "method_not_allowed"),
    ],
)
async def test_what_is_no_route_of_the_control_plane_is_a_json_404_or_405(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    method: str,
    route: str,
    status: int,
    code: str,
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    response = await http.request(method, gateway.url + route)
    assert response.status_code == status and response.json()["error"] == code, response.text
