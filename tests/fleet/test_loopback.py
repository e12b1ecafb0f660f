"""The fleet's links over a Unix socket (fleet/loopback.py, fleet/clients.py): results and raised errors come
back as they were, a gone process is final, a slow one is not, and a call waits for its object's start."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rolloutgate.fleet import loopback
from rolloutgate.fleet.assignment import FleetView
from rolloutgate.fleet.clients import ControllerClient, LinkGone, ReplicaClient
from rolloutgate.fleet.links import ControllerUnreachable, ReplicaUnreachable


class Far:
    """What the far side serves: a replica's calls, one of them slow."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def ping(self, timeout_s: float) -> str:
        return "incarnation-1"

    async def copies_for(self, replica_id: str, replicas: list[str], timeout_s: float) -> list[str]:
        if replica_id == "slow":
            await self.release.wait()
        if replica_id == "bad":
            raise ValueError(f"no such replica {replica_id!r}")
        return [f"{replica_id}<-{r}" for r in replicas]

    async def view(self) -> FleetView:
        return FleetView(
            epoch="e", version=3, replicas={"replica-0": "http://127.0.0.1:1"}, engines={}, owners={}
        )

    async def secret(self) -> str:  # never served: not in the methods given
        return "leaked"


async def test_a_result_and_a_raised_error_cross_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "far.sock"
    runner = await loopback.serve(path, Far(), ["ping", "copies_for", "view"])
    transport = loopback.LoopbackTransport(path)
    try:
        client = ReplicaClient(transport)
        assert await client.ping(5.0) == "incarnation-1"
        copies: list[Any] = await client.copies_for("replica-0", ["a", "b"], 5.0)  # Far's are strings
        assert copies == ["replica-0<-a", "replica-0<-b"]
        with pytest.raises(ValueError, match="no such replica 'bad'"):
            await client.copies_for("bad", [], 5.0)
        view = await ControllerClient(transport).view()
        assert view.version == 3 and view.replicas == {"replica-0": "http://127.0.0.1:1"}
        with pytest.raises(LookupError, match="no method 'secret'"):
            await transport.call("secret")
    finally:
        await transport.close()
        await runner.cleanup()


async def test_a_gone_process_is_final_and_a_slow_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "far.sock"
    far = Far()
    runner = await loopback.serve(path, far, ["ping", "copies_for"])
    transport = loopback.LoopbackTransport(path)
    client = ReplicaClient(transport)
    try:
        with pytest.raises(ReplicaUnreachable) as slow:
            await client.copies_for("slow", [], 0.05)
        assert not slow.value.final, "busy for a moment is not dead"
        far.release.set()
        await runner.cleanup()
        with pytest.raises(LinkGone):
            await transport.call("ping", 1.0)
        with pytest.raises(ReplicaUnreachable) as gone:
            await client.ping(1.0)
        assert gone.value.final, "a socket that refuses: that process is gone"
        with pytest.raises(ControllerUnreachable):
            await ControllerClient(loopback.LoopbackTransport(tmp_path / "never-served.sock")).view()
    finally:
        await transport.close()


async def test_calls_wait_for_the_start_but_a_ping_does_not(tmp_path: Path) -> None:
    path = tmp_path / "far.sock"
    ready = asyncio.Event()
    runner = await loopback.serve(path, Far(), ["ping", "copies_for"], ready=ready)
    transport = loopback.LoopbackTransport(path)
    try:
        client = ReplicaClient(transport)
        assert await client.ping(5.0) == "incarnation-1"
        waiting = asyncio.create_task(client.copies_for("replica-0", ["a"], 5.0))
        await asyncio.sleep(0)
        done, _ = await asyncio.wait([waiting], timeout=0.2)
        assert not done, "no call but a ping before the object started"
        ready.set()
        copies: list[Any] = await waiting
        assert copies == ["replica-0<-a"]
    finally:
        await transport.close()
        await runner.cleanup()
