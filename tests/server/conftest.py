"""Fixtures for gateway tests: simulated engines and gateways over real loopback HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.server.app import GatewayServer
from rolloutsim import SimCluster

MakeGateway = Callable[..., Awaitable[GatewayServer]]
MakeCluster = Callable[..., Awaitable[SimCluster]]


@pytest.fixture
async def make_cluster() -> AsyncIterator[MakeCluster]:
    clusters: list[SimCluster] = []

    async def make(**kwargs: Any) -> SimCluster:
        kwargs.setdefault("engines", 2)
        kwargs.setdefault("api", "sglang")
        kwargs.setdefault("profile", "default")
        kwargs.setdefault("time_scale", 100.0)
        cluster = SimCluster(**kwargs)
        await cluster.__aenter__()
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        await cluster.__aexit__(None, None, None)


@pytest.fixture
async def make_gateway() -> AsyncIterator[MakeGateway]:
    servers: list[GatewayServer] = []

    async def make(cluster: SimCluster | None = None, **settings: Any) -> GatewayServer:
        settings.setdefault("host", "127.0.0.1")
        # Liveness verdicts are tested on purpose with short stall timeouts; elsewhere a generous one keeps a
        # loaded 2-core machine (time-scaled tests) from tripping them by accident.
        settings.setdefault("stall_timeout", 600.0)
        settings.setdefault("port", 0)
        if cluster is not None:
            settings.setdefault(
                "engines", [EngineSpec(url=u, family=cluster_api(cluster)) for u in cluster.urls]
            )
            settings.setdefault("time_scale", cluster.time_scale)
        server = GatewayServer(GatewaySettings(**settings))
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


def cluster_api(cluster: SimCluster) -> str:
    return str(getattr(cluster, "api", "sglang"))


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client
