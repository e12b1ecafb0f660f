"""The links of fleet/links.py over any transport that calls a method of the far side by name.

Theory of operation: a transport (Ray actor handles, fleet/handles.py; a Unix socket to a sibling process,
fleet/loopback.py) carries `method(*args)` to the other side's object and its answer back. It raises
`LinkGone` when the far side is gone for good (a dead actor, a process whose socket refuses) and
`TimeoutError` when no answer came in time (maybe only busy); everything else the far side raised comes back
as it was. The typed wrappers here turn those two into the links' own errors once, for every transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

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

__all__ = ("CONTROLLER_CALL_TIMEOUT_S", "ControllerClient", "LinkGone", "ReplicaClient", "Transport")

CONTROLLER_CALL_TIMEOUT_S = 60.0  # a controller call never waits on anything slower than an engine probe


class LinkGone(Exception):
    """The far side is gone for good (this incarnation): its name of why."""


class Transport(Protocol):
    async def call(self, method: str, *args: Any) -> Any:
        """`method(*args)` on the far side's object. Raises LinkGone, or what the far side raised."""
        ...


async def _bounded(transport: Transport, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
    async with asyncio.timeout(timeout_s):
        return await transport.call(method, *args)


class ReplicaClient:
    """The controller's link to one replica, and a replica's to a peer (fleet/links.py ReplicaLink)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def _call(self, method: str, *args: Any, timeout_s: float, timed_out: str) -> Any:
        try:
            return await _bounded(self._transport, method, args, timeout_s)
        except LinkGone as exc:
            raise ReplicaUnreachable(str(exc), final=True) from None
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
            timeout_s,
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
            timeout_s,
            timeout_s=timeout_s,
            timed_out=f"copies_for: no answer in {timeout_s:g} s",
        )
        return copies


class ControllerClient:
    """A replica's link to the controller (fleet/links.py ControllerLink)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def _call(self, method: str, *args: Any, timeout_s: float = CONTROLLER_CALL_TIMEOUT_S) -> Any:
        try:
            return await _bounded(self._transport, method, args, timeout_s)
        except LinkGone as exc:
            raise ControllerUnreachable(str(exc)) from None
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
