"""The controller and the replicas as Ray actors (async: each runs on its actor's event loop).

Theory of operation: thin shells over the plain objects (fleet/controller.py, fleet/replica.py) with their
links made of Ray handles (fleet/handles.py). Each shell starts its object in `__init__`, on the actor's
running loop, so an actor that Ray restarts (`max_restarts`) starts serving and registers again by itself,
with nobody to call it; `ready()` waits for that start and answers its outcome. The launcher
(fleet/launch.py) decides resources, names and restart policies with `.options(...)`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray

from rolloutgate.config import GatewaySettings
from rolloutgate.fleet.assignment import EngineEntry, FleetView
from rolloutgate.fleet.controller import FleetController
from rolloutgate.fleet.handles import controller_client, current_actor, node_ip_address, replica_client
from rolloutgate.fleet.links import EngineChange, JoinResult, ReplicaInfo, SessionChange
from rolloutgate.fleet.operations import ReplicaResult
from rolloutgate.fleet.replica import FleetReplica
from rolloutgate.server.answer import Answer
from rolloutgate.sessions.registry import SessionCopy

__all__ = ("ControllerActor", "ReplicaActor", "run_at_normal_priority")

log = logging.getLogger("rolloutgate.fleet")


class _Controller:
    """The controller actor: fleet/controller.py's methods, over Ray."""

    def __init__(
        self,
        engines: Sequence[EngineEntry],
        ping_interval_s: float,
        ping_timeout_s: float,
        ping_failures: int,
        expected_replicas: int = 1,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
        self._controller = FleetController(
            engines,
            link_factory=replica_client,
            ping_interval_s=ping_interval_s,
            ping_timeout_s=ping_timeout_s,
            ping_failures=ping_failures,
            expected_replicas=expected_replicas,
        )
        self._started = asyncio.get_running_loop().create_task(self._controller.start())

    async def ready(self) -> str:
        await self._started
        return self._controller.epoch

    async def register_replica(
        self, info: ReplicaInfo, handle: object, engines: Sequence[EngineEntry]
    ) -> FleetView:
        return await self._controller.register_replica(info, handle, engines)

    async def deregister_replica(self, replica_id: str, incarnation: str) -> FleetView:
        return await self._controller.deregister_replica(replica_id, incarnation)

    async def previous_url(self, replica_id: str) -> str | None:
        return await self._controller.previous_url(replica_id)

    async def next_view(self, after_version: int, timeout_s: float, epoch: str) -> FleetView:
        return await self._controller.next_view(after_version, timeout_s, epoch)

    async def view(self) -> FleetView:
        return await self._controller.view()

    async def add_engine(self, entry: EngineEntry, wait_s: float) -> EngineChange:
        return await self._controller.add_engine(entry, wait_s)

    async def remove_engine(self, ref: str) -> EngineChange:
        return await self._controller.remove_engine(ref)

    async def suspect(self, replica_id: str) -> None:
        await self._controller.suspect(replica_id)

    async def departures(self) -> list[tuple[str, str]]:
        return list(self._controller.departures)

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> Answer:
        return await self._controller.operate(name, body, query)


def run_at_normal_priority() -> None:
    """Ray starts its workers at nice 15 (raylet's `worker_niceness`), under everything else on the node. A
    gateway's latency is every client's: measured on a busy 2-core machine, +1.4 ms on `/health` and +4 ms
    on a 1-token `/generate` at nice 15. Where the process may not raise its priority back, say so: then
    start Ray with `RAY_worker_niceness=0` (docs/fleet.md)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as exc:
        log.warning("replica left at Ray's worker niceness %d (%s)", os.getpriority(os.PRIO_PROCESS, 0), exc)


class _Replica:
    """A replica actor: a gateway serving HTTP on its node (fleet/replica.py), over Ray."""

    def __init__(
        self,
        replica_id: str,
        settings: GatewaySettings,
        controller_name: str,
        advertise_host: str | None = None,  # "node": this node's IP
        shared_port: int | None = None,
    ) -> None:
        logging.basicConfig(
            level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
        )
        run_at_normal_priority()
        self._replica = FleetReplica(
            replica_id,
            settings,
            # by name, not a handle passed in: the arguments of an actor Ray restarts must outlive its start
            controller_client(ray.get_actor(controller_name)),
            handle=current_actor(),
            peer_link=replica_client,
            advertise_host=node_ip_address() if advertise_host == "node" else advertise_host,
            shared_port=shared_port,
        )
        self._started = asyncio.get_running_loop().create_task(self._replica.start())

    async def ready(self) -> str:
        """The replica's URL once it serves (raises what its start raised)."""
        return await self._started

    async def ping(self, timeout_s: float) -> str:
        return await self._replica.ping(timeout_s)

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        await self._started
        return await self._replica.joined(url, version, timeout_s)

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> ReplicaResult:
        await self._started
        return await self._replica.operate(name, body, query)

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        await self._started
        return await self._replica.replicate(changes, timeout_s)

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        await self._started
        return await self._replica.copies_for(replica_id, replicas, timeout_s)

    async def describe(self) -> dict[str, Any]:
        await self._started
        return {
            **self._replica.describe(),
            "pid": os.getpid(),
            "node_ip": node_ip_address(),
            "cpu_s": time.process_time(),  # the process's CPU so far, every thread
            "loop_cpu_s": time.thread_time(),  # its event loop's thread alone: the gateway's own work
        }

    async def stop(self, grace_s: float | None = None) -> None:
        await self._started
        await self._replica.stop(grace_s)


ControllerActor = ray.remote(_Controller)
ReplicaActor = ray.remote(_Replica)
