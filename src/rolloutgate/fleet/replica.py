"""A fleet replica: one production gateway (server/app.py) serving its shard of the engines, following the
controller's view.

Theory of operation: `FleetReplica.start` runs a `GatewayServer` on this event loop (inside a Ray actor,
fleet/actors.py: the actor's own loop) with no engines of its own, its app routed through the fleet
(fleet/edge.py) and its session ids naming it (fleet/assignment.py `mint_session_id`); then it registers with
the controller and follows its view with a long poll:

- an engine the view gives it joins its pool (`EnginePool.add`, retried while the engine cannot be reached,
  as at a gateway's start-up); one the view takes away is handed over drained: it takes no new work here
  (core `EngineDraining`), its calls here run to their end while the new owner already sends it work, and it
  leaves the pool once they are done (or after the request timeout: what still runs is then re-queued on
  this replica's other engines, `EnginePool.remove`). Given back meanwhile, it simply takes work again;
- a view of a new controller epoch (the controller restarted), or one that no longer lists this incarnation
  (taken out while alive, e.g. frozen past the ping timeout), makes it register again; after a restart with
  the engines it holds, so none is forgotten.

A replica that Ray restarts binds the port it had where it can, so the URLs agents hold (a session's base URL
names its replica) reach it again.

Its sessions' records are kept on a second replica too (fleet/replication.py): after each change its session
service waits for the backup's copy; at every view change it sends whole sessions to new backups; after it
registers it pulls the copies its peers hold of its sessions, and serves no session before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.events import EngineDraining
from rolloutgate.engines.base import UpstreamError
from rolloutgate.fleet import edge
from rolloutgate.fleet.assignment import EngineEntry, FleetView, check_replica_id, mint_session_id
from rolloutgate.fleet.links import (
    ControllerLink,
    ControllerUnreachable,
    JoinResult,
    ReplicaInfo,
    ReplicaLink,
    SessionChange,
)
from rolloutgate.fleet.operations import ReplicaResult, run_here
from rolloutgate.fleet.replication import Replication
from rolloutgate.server.app import GatewayServer
from rolloutgate.server.context import CONTEXT
from rolloutgate.server.pool import EnginePool
from rolloutgate.sessions.registry import SessionCopy
from rolloutgate.sessions.service import SessionService

__all__ = ("FleetReplica",)

log = logging.getLogger("rolloutgate.fleet")

POLL_TIMEOUT_S = 10.0  # a long poll's length: how stale a replica's view can be if a change were missed
CONTROLLER_RETRY_S = 1.0  # between calls to a controller that does not answer (restarting)
DRAIN_POLL_S = 0.25  # how often a handed-over engine's calls here are counted


@dataclass(eq=False)
class _Joining:
    """An engine this replica owns, on its way into the pool (or in it, once `task` is done)."""

    entry: EngineEntry
    task: asyncio.Task[None] | None  # None: in the pool already (given back while it drained)
    first_try: asyncio.Future[str | None]  # set after the first attempt: None (joined) or why not


@dataclass(eq=False)
class FleetReplica:
    """One replica (module docstring). `handle`: what the controller and its peers reach it by (its Ray actor
    handle; in one process, the replica itself); `peer_link`: a peer's link from its handle."""

    replica_id: str
    settings: GatewaySettings
    controller: ControllerLink
    handle: object = None
    peer_link: Callable[[object], ReplicaLink] = lambda handle: handle  # type: ignore[assignment, return-value]
    advertise_host: str | None = None  # the host in its URL, where it binds all addresses (0.0.0.0)
    shared_port: int | None = None  # the fleet's one URL on this node, shared with the replicas beside it
    # in `/health`: the gateway's identity, where processes share one port (fleet/processes.py)
    instance_id: str | None = None
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    server: GatewayServer | None = field(default=None, init=False)
    _view: FleetView | None = field(default=None, init=False)
    _url: str = field(default="", init=False)
    _joining: dict[str, _Joining] = field(default_factory=dict, init=False)
    _handing_over: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)
    _applied: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _follower: asyncio.Task[None] | None = field(default=None, init=False)
    _background: set[asyncio.Task[Any]] = field(default_factory=set, init=False)
    replication: Replication | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        check_replica_id(self.replica_id)
        if self.settings.sim or self.settings.engines:
            raise ValueError("a fleet replica gets its engines from the controller: no --sim, no --engine")

    # -- what the edge reads (fleet/edge.py FleetMember) -----------------------------------------------------

    @property
    def url(self) -> str:
        return self._url

    @property
    def view(self) -> FleetView:
        assert self._view is not None, "the replica registers before it serves"
        return self._view

    def suspect(self, replica_id: str) -> None:
        self._spawn(self._suspect(replica_id))

    async def _suspect(self, replica_id: str) -> None:
        with contextlib.suppress(ControllerUnreachable):
            await self.controller.suspect(replica_id)

    def _state_section(self) -> dict[str, Any]:
        """`/admin/state`'s "fleet": this replica, and the fleet as its view has it."""
        view = self.view
        return {
            "replica_id": self.replica_id,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "epoch": view.epoch,
            "view_version": view.version,
            "replicas": dict(view.replicas),
            "owners": dict(view.owners),
            "handing_over": sorted(self._handing_over),
            "replication": dict(self.replication.counts) if self.replication is not None else {},
        }

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve, register, follow the view; returns the replica's URL."""
        # a request may come as soon as the port is open: until the controller's view, an empty one (all here)
        self._view = FleetView(epoch="", version=-1, replicas={}, engines={}, owners={})
        port = self.settings.port or await self._previous_port()
        update: dict[str, Any] = {"port": port}
        if self.settings.state_dir:  # a store is one gateway's (it locks its folder): one folder a replica
            update["state_dir"] = str(Path(self.settings.state_dir) / self.replica_id)
        if self.settings.record_trace:  # one file a replica, of the requests it served: FILE.<replica id>
            update["record_trace"] = f"{self.settings.record_trace}.{self.replica_id}"
        server = GatewayServer(
            self.settings.model_copy(update=update),
            configure_app=self._configure,
            shared_port=self.shared_port,
        )
        self.server = server
        self._url = await server.start()
        if self.advertise_host:
            self._url = self._url.replace(f"//{self.settings.host}:", f"//{self.advertise_host}:", 1)
        await self._apply(await self._register(restarted_controller=False))
        assert self.replication is not None
        self._spawn(self.replication.pull())  # sessions are served once it is done (fleet/edge.py)
        self._follower = asyncio.create_task(self._follow(), name=f"fleet-follow-{self.replica_id}")
        log.info("replica %s serving on %s", self.replica_id, self._url)
        return self._url

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving (the gateway's graceful shutdown), then leave the fleet."""
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(grace_s)
        with contextlib.suppress(ControllerUnreachable):
            await self.controller.deregister_replica(self.replica_id, self.incarnation)
        tasks = [j.task for j in self._joining.values() if j.task is not None]
        tasks += list(self._handing_over.values())
        tasks += list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.replication is not None:
            await self.replication.close()

    def _configure(self, app: web.Application) -> None:
        edge.install(app, self)
        if self.instance_id is not None:
            app[CONTEXT].instance_id = self.instance_id
        app[CONTEXT].state_sections["fleet"] = self._state_section
        sessions: SessionService = app[CONTEXT].extras["sessions"]
        sessions.registry.mint_ids_with(lambda: mint_session_id(self.replica_id, uuid.uuid4().hex))
        self.replication = Replication(
            self.replica_id, sessions.registry, sessions.clock.now, lambda: self.view, self.peer_link
        )
        sessions.settle = self.replication.settle

    async def sessions_ready(self) -> None:
        """Returns once this replica holds its sessions' latest records (its pull after joining)."""
        assert self.replication is not None
        await self.replication.ready()

    async def _previous_port(self) -> int:
        """The port this replica had before Ray restarted it, if it is free; else 0 (any)."""
        try:
            previous = await self.controller.previous_url(self.replica_id)
        except ControllerUnreachable:
            return 0
        if not previous:
            return 0
        port = int(previous.rsplit(":", 1)[1])
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.settings.host, port))
            except OSError:
                return 0
        return port

    # -- the controller's calls (fleet/links.py ReplicaLink) ---------------------------------------------------

    async def ping(self, timeout_s: float) -> str:
        return self.incarnation

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.view.version < version and loop.time() < deadline:  # bounded by the deadline
            self._applied.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self._applied.wait()
        joining = self._joining.get(url)
        if joining is None:
            return JoinResult(ok=False, error=f"replica {self.replica_id} does not own {url}")
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                error = await asyncio.shield(joining.first_try)
        except TimeoutError:
            return JoinResult(ok=False, error=f"no answer from {url} in {timeout_s:.0f} s")
        if error is not None:
            return JoinResult(ok=False, error=error)
        pool = self._pool()
        handle = pool.by_url(url)
        return JoinResult(ok=True, worker=pool.describe(handle) if handle is not None else {"url": url})

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> ReplicaResult:
        assert self.server is not None
        return await run_here(self.server.app, name, body, query)

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        assert self.replication is not None
        return self.replication.receive(changes)

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        assert self.replication is not None
        return self.replication.copies_for(replica_id, replicas)

    def describe(self) -> dict[str, Any]:
        """The replica at a glance: id, URL, view version, its engines as its pool holds them."""
        pool = self._pool()
        return {
            "replica_id": self.replica_id,
            "url": self._url,
            "incarnation": self.incarnation,
            "view_version": self.view.version,
            "owned": sorted(self._joining),
            "engines": [pool.describe(h) for h in pool.engines.values()],
        }

    # -- following the view ------------------------------------------------------------------------------------

    def _pool(self) -> EnginePool:
        assert self.server is not None
        return self.server.context.pool

    async def _register(self, *, restarted_controller: bool) -> FleetView:
        held = [j.entry for j in self._joining.values()] if restarted_controller else []
        info = ReplicaInfo(self.replica_id, self._url, self.incarnation)
        return await self.controller.register_replica(info, self.handle or self, held)

    async def _follow(self) -> None:
        while True:  # the replica's lifetime; each call bounded by POLL_TIMEOUT_S
            try:
                view = await self.controller.next_view(self.view.version, POLL_TIMEOUT_S, self.view.epoch)
                if view.epoch != self.view.epoch:
                    log.warning("replica %s: the controller restarted; registering again", self.replica_id)
                    view = await self._register(restarted_controller=True)
                elif view.incarnations.get(self.replica_id) != self.incarnation:
                    await self._apply(view)  # drop what it no longer owns before it takes a share again
                    log.warning("replica %s was taken out of the fleet; registering again", self.replica_id)
                    view = await self._register(restarted_controller=False)
            except ControllerUnreachable as exc:
                log.warning("replica %s: the controller did not answer (%s)", self.replica_id, exc)
                await asyncio.sleep(CONTROLLER_RETRY_S)
                continue
            await self._apply(view)

    async def _apply(self, view: FleetView) -> None:
        mine = set(view.engines_of(self.replica_id)) if self.replica_id in view.replicas else set()
        for url in [u for u in self._joining if u not in mine]:
            self._drop(url)
        for url in mine:
            if url not in self._joining:
                self._join(view.engines[url])
        if self.server is not None:  # its engines' lags count from the fleet's newest weights
            self._pool().learn_peer_versions(view.weight_versions)
        old, self._view = self._view, view
        if self.replication is not None and old is not None:
            self.replication.view_changed(old, view)
        self._applied.set()

    def _join(self, entry: EngineEntry) -> None:
        first_try: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        handing_over = self._handing_over.pop(entry.url, None)
        handle = self._pool().by_url(entry.url) if handing_over is not None else None
        if handing_over is not None:
            handing_over.cancel()
        if handle is not None:  # given back while it drained: it takes work here again
            self._pool().emit(EngineDraining(engine_id=handle.engine_id, draining=False))
            first_try.set_result(None)
            task = None
        else:
            task = asyncio.create_task(self._join_until_in(entry, first_try), name=f"fleet-join-{entry.url}")
        self._joining[entry.url] = _Joining(entry, task, first_try)
        log.info("replica %s takes engine %s", self.replica_id, entry.url)

    async def _join_until_in(self, entry: EngineEntry, first_try: asyncio.Future[str | None]) -> None:
        """Add the engine to the pool, retrying while it cannot be reached; cancelled if the replica stops
        owning it. `first_try` is set after the first attempt, whatever its outcome."""
        server = self.server
        assert server is not None
        spec = EngineSpec.model_validate(
            {"url": entry.url, "family": entry.family, "capacity": entry.capacity}
        )
        retry_s = server.context.driver.clock.real_seconds(self.settings.health_interval)
        try:
            while True:
                try:
                    await self._pool().add(spec)
                    if not first_try.done():
                        first_try.set_result(None)
                    return
                except UpstreamError as exc:
                    log.warning("engine %s not reachable yet (%s); retrying", entry.url, exc.message)
                    if not first_try.done():
                        first_try.set_result(exc.message)
                await asyncio.sleep(retry_s)
        finally:
            if not first_try.done():
                first_try.set_result("the replica stopped owning it")

    def _drop(self, url: str) -> None:
        joining = self._joining.pop(url)
        if joining.task is not None:
            joining.task.cancel()
        handle = self._pool().by_url(url)
        if handle is not None:
            self._handing_over[url] = asyncio.create_task(self._hand_over(url, handle.engine_id))
        log.info("replica %s hands engine %s over", self.replica_id, url)

    async def _hand_over(self, url: str, engine_id: str) -> None:
        """Drain the engine here (module docstring), then drop it from the pool."""
        server = self.server
        assert server is not None
        pool, core = self._pool(), server.context.driver.core
        pool.emit(EngineDraining(engine_id=engine_id))
        longest_s = server.context.driver.clock.real_seconds(self.settings.timeout)
        try:
            for _ in range(math.ceil(longest_s / DRAIN_POLL_S)):  # polled: the core has no drained event
                if not core.in_flight_on(engine_id):
                    break
                await asyncio.sleep(DRAIN_POLL_S)
        finally:
            if self._handing_over.get(url) is asyncio.current_task():
                del self._handing_over[url]
        pool.remove(engine_id)
        log.info("replica %s: engine %s drained and handed over", self.replica_id, url)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
