"""Reading gateways over real HTTP (top/fetch.py): a gateway over simulated engines, a fleet of two (each
replica's `/admin/state` carrying the fleet section a replica serves), and gateways that cannot be read."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import httpx
import pytest

from rolloutgate.server.app import GatewayServer
from rolloutgate.top.fetch import GatewayReader
from tests.server.conftest import MakeCluster, MakeGateway

pytestmark = pytest.mark.looptime

SCALE = 50.0
DEAD_URL = "http://127.0.0.1:9"  # discard: nothing listens


def chat(max_tokens: int) -> dict[str, Any]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return body | {"ignore_eos": True}


def as_fleet(replicas: dict[str, str], *gateways: tuple[str, GatewayServer]) -> None:
    """Each gateway serves the fleet section a replica of `replicas` serves in its `/admin/state`."""
    for replica_id, gateway in gateways:
        section = {"replica_id": replica_id, "replicas": replicas}
        gateway.context.state_sections["fleet"] = lambda section=section: section


async def test_a_gateway_is_read_whole(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    assert (await http.post(f"{gateway.url}/v1/chat/completions", json=chat(50))).status_code == 200
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        (snapshot,) = await GatewayReader(session, clock=loop.time).read_all(gateway.url)
    assert snapshot.error is None and snapshot.replica_id is None and snapshot.url == gateway.url
    assert snapshot.taken_at == pytest.approx(loop.time(), abs=1.0)
    assert sorted(e["url"] for e in snapshot.engines) == sorted(cluster.urls)
    for engine in snapshot.engines:
        assert {"running", "queued", "prefilling", "quarantined", "paused_by_gate", "silent_s"} <= set(engine)
    assert sum(e["generated_tokens"] for e in snapshot.engines) == 50
    assert snapshot.samples.total("rolloutgate_generated_tokens_total") == 50
    assert snapshot.samples.total("rolloutgate_clock_seconds_count", clock="wall") == 1


async def test_a_fleet_replica_leads_to_every_replica(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    first_engines = await make_cluster(engines=1, time_scale=SCALE)
    second_engines = await make_cluster(engines=2, time_scale=SCALE)
    first, second = await make_gateway(first_engines), await make_gateway(second_engines)
    as_fleet({"replica-0": first.url, "replica-1": second.url}, ("replica-0", first), ("replica-1", second))
    async with aiohttp.ClientSession() as session:
        snapshots = await GatewayReader(session).read_all(second.url)  # any replica will do
    assert [(s.replica_id, s.url, s.error) for s in snapshots] == [
        ("replica-0", first.url, None),
        ("replica-1", second.url, None),
    ]
    assert [sorted(e["url"] for e in s.engines) for s in snapshots] == [
        sorted(first_engines.urls),
        sorted(second_engines.urls),
    ]


async def test_a_replica_that_does_not_answer_is_read_as_unreachable(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1, time_scale=SCALE))
    as_fleet({"replica-0": gateway.url, "replica-1": DEAD_URL}, ("replica-0", gateway))
    async with aiohttp.ClientSession() as session:
        alive, dead = await GatewayReader(session).read_all(gateway.url)
    assert (alive.replica_id, alive.error) == ("replica-0", None)
    assert (dead.replica_id, dead.url, dead.state, dead.error is not None) == (
        "replica-1",
        DEAD_URL,
        {},
        True,
    )


async def test_a_gateway_with_an_admin_token_is_read_with_it_and_refuses_without(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1, time_scale=SCALE), admin_token="s3cret")
    async with aiohttp.ClientSession() as session:
        (refused,) = await GatewayReader(session).read_all(gateway.url)
        (read,) = await GatewayReader(session, admin_token="s3cret").read_all(gateway.url)
    assert refused.error is not None and "HTTP 401" in refused.error and "admin token" in refused.error
    assert read.error is None and len(list(read.engines)) == 1
