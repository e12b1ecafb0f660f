"""Ray actor handles as the links of fleet/links.py: typed calls, Ray's errors turned into ours.

Theory of operation: a Ray actor handle's methods are untyped (`handle.method.remote(...)` is an awaitable
ObjectRef of Any), so each call is wrapped once here with its real types. Ray's liveness is what these
errors carry: an actor that died raises `ActorDiedError`, one that Ray is restarting `ActorUnavailableError`
(both: this incarnation is gone, `final`); a call that does not come back in time is a plain timeout
(not final: a replica busy for a moment).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rolloutgate.fleet.assignment import EngineEntry, FleetView
from rolloutgate.fleet.links import (
    ControllerUnreachable,
    EngineChange,
    JoinResult,
    ReplicaInfo,
    ReplicaUnreachable,
    SessionChange,
)
from rolloutgate.fleet.operations import ReplicaResult, operation_named
from rolloutgate.server.answer import Answer
from rolloutgate.sessions.registry import SessionCopy

__all__ = ("ControllerClient", "ReplicaClient", "current_actor", "node_ip_address")

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)
CONTROLLER_CALL_TIMEOUT_S = 60.0  # a controller call never waits on anything slower than an engine probe


def current_actor() -> Any:
    """The handle of the actor this code runs in (what a replica registers with)."""
    return ray.get_runtime_context().current_actor


def node_ip_address() -> str:
    """This node's IP as Ray knows it (where other nodes reach its replicas)."""
    # untyped in Ray; `unused-ignore`: `make lint` also checks this without Ray installed (pyproject.toml)
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call, unused-ignore]
    return address


class ReplicaClient:
    """The controller's link to one replica actor (fleet/links.py ReplicaLink)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle  # a Ray ActorHandle of fleet/actors.py ReplicaActor

    async def _call(self, method: str, *args: Any, timeout_s: float, timed_out: str) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await getattr(self._handle, method).remote(*args)
        except _GONE as exc:
            raise ReplicaUnreachable(type(exc).__name__, final=True) from None
        except TimeoutError:
            raise ReplicaUnreachable(timed_out) from None

    async def ping(self, timeout_s: float) -> str:
        incarnation: str = await self._call(
            "ping", timeout_s, timeout_s=timeout_s, timed_out=f"no answer to a ping in {timeout_s:g} s"
        )
        return incarnation

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        result: JoinResult = await self._call(
            "joined",
            url,
            version,
            timeout_s,
            timeout_s=timeout_s + 5.0,
            timed_out=f"no answer in {timeout_s:g} s",
        )
        return result

    async def operate(
        self, name: str, body: dict[str, Any], query: dict[str, str], timeout_s: float
    ) -> ReplicaResult:
        result: ReplicaResult = await self._call(
            "operate",
            name,
            body,
            query,
            timeout_s=timeout_s,
            timed_out=f"{name}: no answer in {timeout_s:g} s",
        )
        return result

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        wanted: list[str] = await self._call(
            "replicate",
            list(changes),
            timeout_s=timeout_s,
            timed_out=f"replicate: no answer in {timeout_s:g} s",
        )
        return wanted

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        copies: list[SessionCopy] = await self._call(
            "copies_for",
            replica_id,
            list(replicas),
            timeout_s=timeout_s,
            timed_out=f"copies_for: no answer in {timeout_s:g} s",
        )
        return copies


class ControllerClient:
    """A replica's link to the controller actor (fleet/links.py ControllerLink)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle  # a Ray ActorHandle of fleet/actors.py ControllerActor

    async def _call(self, method: str, *args: Any, timeout_s: float = CONTROLLER_CALL_TIMEOUT_S) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await getattr(self._handle, method).remote(*args)
        except _GONE as exc:
            raise ControllerUnreachable(type(exc).__name__) from None
        except TimeoutError:
            raise ControllerUnreachable(f"{method}: no answer in {timeout_s:g} s") from None

    async def register_replica(
        self, info: ReplicaInfo, handle: object, engines: Sequence[EngineEntry]
    ) -> FleetView:
        view: FleetView = await self._call("register_replica", info, handle, list(engines))
        return view

    async def deregister_replica(self, replica_id: str, incarnation: str) -> FleetView:
        view: FleetView = await self._call("deregister_replica", replica_id, incarnation)
        return view

    async def previous_url(self, replica_id: str) -> str | None:
        url: str | None = await self._call("previous_url", replica_id)
        return url

    async def next_view(self, after_version: int, timeout_s: float, epoch: str) -> FleetView:
        view: FleetView = await self._call(
            "next_view", after_version, timeout_s, epoch, timeout_s=timeout_s + 10.0
        )
        return view

    async def view(self) -> FleetView:
        view: FleetView = await self._call("view")
        return view

    async def add_engine(self, entry: EngineEntry, wait_s: float) -> EngineChange:
        change: EngineChange = await self._call("add_engine", entry, wait_s, timeout_s=wait_s + 30.0)
        return change

    async def remove_engine(self, ref: str) -> EngineChange:
        change: EngineChange = await self._call("remove_engine", ref)
        return change

    async def suspect(self, replica_id: str) -> None:
        await self._call("suspect", replica_id)

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> Answer:
        # the replicas' own time limits bound it (fleet/operations.py); this one only outlasts them
        operation = operation_named(name)
        answer: Answer = await self._call("operate", name, body, query, timeout_s=operation.timeout_s + 30.0)
        return answer
