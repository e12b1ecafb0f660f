"""Fixtures for simulator tests: clusters on ephemeral loopback ports and an aiohttp client session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from rolloutsim import SimCluster

ClusterFactory = Callable[..., Awaitable[SimCluster]]


@pytest.fixture
async def make_cluster() -> AsyncIterator[ClusterFactory]:
    started: list[SimCluster] = []

    async def factory(**kwargs: Any) -> SimCluster:
        cluster = SimCluster(**kwargs)
        await cluster.start()
        started.append(cluster)
        return cluster

    yield factory
    for cluster in started:
        await cluster.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as client:
        yield client
