"""The fleet's controller and replicas in one process, linked directly (no Ray), for the tests: real loopback
HTTP against simulated SGLang engines; a replica can be killed, slowed or restarted. tests/fleet/conftest.py
makes it the `fleet` fixture."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from rolloutgate.config import GatewaySettings
from rolloutgate.fleet.assignment import EngineEntry, FleetView
from rolloutgate.fleet.controller import FleetController
from rolloutgate.fleet.links import JoinResult, ReplicaLink, ReplicaUnreachable, SessionChange
from rolloutgate.fleet.operations import ReplicaResult
from rolloutgate.fleet.replica import FleetReplica
from rolloutgate.sessions.registry import SessionCopy
from rolloutsim import SimCluster
from tests.ports import port_of, reserved_port

REPLICAS = 3
ENGINES = 6


@dataclass(eq=False)
class KillableLink:
    """The controller's link to an in-process replica; `kill()` makes it answer as Ray does for a dead actor."""

    replica: FleetReplica | None = None
    dead: bool = False
    too_slow: bool = False  # its operations time out while its pings still answer (a replica busy for long)

    def _alive(self) -> FleetReplica:
        if self.dead or self.replica is None:
            raise ReplicaUnreachable("ActorDiedError", final=True)
        return self.replica

    async def ping(self, timeout_s: float) -> str:
        return await self._alive().ping(timeout_s)

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        return await self._alive().joined(url, version, timeout_s)

    async def operate(
        self, name: str, body: dict[str, Any], query: dict[str, str], timeout_s: float
    ) -> ReplicaResult:
        replica = self._alive()
        if self.too_slow:
            raise ReplicaUnreachable(f"{name}: no answer in {timeout_s:g} s")
        return await replica.operate(name, body, query)

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        return await self._alive().replicate(changes, timeout_s)

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        return await self._alive().copies_for(replica_id, replicas, timeout_s)


@dataclass(eq=False)
class LocalFleet:
    cluster: SimCluster
    controller: FleetController
    replicas: list[FleetReplica]
    links: list[KillableLink]
    spare: SimCluster
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=60))

    async def kill(self, index: int) -> None:
        """The replica's process is gone: its link raises, its server stops answering at once."""
        self.links[index].dead = True
        replica = self.replicas[index]
        if replica._follower is not None:
            replica._follower.cancel()
        assert replica.server is not None and replica.server.runner is not None
        server = replica.server.runner.server
        assert server is not None
        for connection in server.connections:  # cut as a dying process's are, not closed gracefully
            if connection.transport is not None:
                connection.transport.abort()
        await replica.server.runner.cleanup()

    async def restart(self, index: int) -> FleetReplica:
        """A new incarnation of replica `index` (as Ray restarts one): same id, same settings."""
        link = KillableLink()
        old = self.replicas[index]
        reborn = FleetReplica(
            old.replica_id, old.settings, self.controller, handle=link, shared_port=old.shared_port
        )
        link.replica = reborn
        with contextlib.suppress(OSError):
            await reborn.start()
        self.replicas[index], self.links[index] = reborn, link
        return reborn

    async def owners_by_replica(self, indices: list[int]) -> dict[str, list[str]]:
        """Each replica's own pool, read from its /admin/state."""
        out = {}
        for i in indices:
            state = (await self.http.get(f"{self.replicas[i].url}/admin/state")).json()
            out[self.replicas[i].replica_id] = sorted(e["url"] for e in state["engines"])
        return out


def link_of(handle: object) -> ReplicaLink:
    assert isinstance(handle, KillableLink)
    return handle


@contextlib.asynccontextmanager
async def local_fleet(**settings: Any) -> AsyncIterator[LocalFleet]:
    """The fleet of the tests: REPLICAS replicas over ENGINES simulated SGLang engines at x100, a spare engine;
    `settings`: the replicas' gateway settings beyond the tests' own."""
    with reserved_port() as reservation:  # the replicas' shared port, held for the fleet's life
        async with SimCluster(engines=ENGINES, time_scale=100.0) as cluster, SimCluster(engines=1) as spare:
            controller = FleetController(
                [EngineEntry(url, family="sglang") for url in cluster.urls],
                link_factory=link_of,
                ping_interval_s=0.1,
                expected_replicas=REPLICAS,
            )
            await controller.start()
            base = {"port": 0, "time_scale": 100.0, "stall_timeout": 600.0, "log_level": "warning"}
            replica_settings = GatewaySettings(**{**base, **settings})
            shared_port = port_of(reservation)
            replicas, links = [], []
            for i in range(REPLICAS):
                link = KillableLink()
                replica = FleetReplica(
                    f"replica-{i}", replica_settings, controller, handle=link, shared_port=shared_port
                )
                link.replica = replica
                await replica.start()
                replicas.append(replica)
                links.append(link)
            local = LocalFleet(cluster, controller, replicas, links, spare)
            await wait_until(lambda: all_joined(local))
            try:
                yield local
            finally:
                for replica, link in zip(replicas, links, strict=True):
                    if not link.dead:
                        await replica.stop(grace_s=0)
                await controller.close()
                await local.http.aclose()


def all_joined(fleet: LocalFleet) -> bool:
    live = [r for r, link in zip(fleet.replicas, fleet.links, strict=True) if not link.dead]
    view = fleet.controller.latest
    return all(
        len(r.server.context.pool.engines) == len(view.engines_of(r.replica_id))
        and r.view.version == view.version
        for r in live
    )


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not condition():
        assert loop.time() - start < timeout_s, "condition not met in time"
        await asyncio.sleep(0.02)
    return loop.time() - start


def generate(key: str) -> tuple[dict[str, object], dict[str, str]]:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}}
    return body, {"X-SMG-Routing-Key": key}


def long_generate(key: str, tokens: int) -> tuple[dict[str, object], dict[str, str]]:
    body = {
        "input_ids": list(range(1, 65)),
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    return body, {"X-SMG-Routing-Key": key}


def key_owned_by(view: FleetView, replica_id: str, prefix: str) -> str:
    return next(k for k in (f"{prefix}{i}" for i in range(500)) if view.key_owner(k) == replica_id)
