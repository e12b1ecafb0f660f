"""`rolloutgate serve --processes N`: one gateway on one port from N processes of this host, without Ray.

Theory of operation: the fleet of fleet/replica.py and fleet/controller.py, its links over Unix sockets
(fleet/loopback.py) instead of Ray.

- The parent process holds the port (bound with SO_REUSEPORT, never listening: connections go only to the
  children, and no other program can take the port between two of them), runs the controller on its event
  loop, and starts N children (`multiprocessing`'s spawn: a fresh interpreter each, no state copied from a
  running loop).
- Each child is a fleet replica: it listens on the shared port (the kernel spreads the clients' connections
  over the children) and on a private one of its own, the URL its peers forward to. The controller gives each
  child a share of the engines, and each engine has one owner, so its clocks and admission are exact; a
  request for an engine another child owns (a session's turn, a routing key) takes the fleet's one hop
  (fleet/edge.py). A call without a key is served where it lands, if that child owns an engine.
- Liveness: the parent sees a child exit at once (its process sentinel) and has the controller check it: its
  socket refuses, and its engines go to the others in that step. The controller's own pings (every
  `PING_INTERVAL_S`) are left to find a child that hangs. The parent starts a new incarnation of the same
  replica after `RESPAWN_DELAY_S` (as Ray restarts an actor), which registers and takes a share back.
- Start-up fails as a whole if any child dies before it serves (a bad setting fails in every child alike).
  SIGTERM/SIGINT: the controller's liveness checks stop first (no engine changes owner because a child is
  stopping), then each child gets SIGTERM and its graceful shutdown, and leaves the fleet; a second signal cuts
  every grace short. The children ignore
  SIGINT: a terminal's Ctrl-C reaches the whole process group, and the parent alone decides what it means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.fleet import loopback
from rolloutgate.fleet.assignment import EngineEntry
from rolloutgate.fleet.clients import ControllerClient
from rolloutgate.fleet.controller import FleetController
from rolloutgate.fleet.replica import FleetReplica
from rolloutgate.server.process import (
    event_loop_factory,
    keep_large_buffers_returnable,
    tune_gc,
    until_stop_signal,
)
from rolloutgate.vocabulary import folder_vocab_size

__all__ = ("CONTROLLER_METHODS", "REPLICA_METHODS", "serve_processes")

log = logging.getLogger("rolloutgate.fleet")

START_TIMEOUT_S = 120.0  # a child's start: an interpreter, the gateway's imports, its engines' first probe
RESPAWN_DELAY_S = 1.0  # between a child's death and its next incarnation (a crash loop is then 1 a second)
STOP_MARGIN_S = 10.0  # past a child's grace before it is killed
FIRST_JOIN_S = 30.0  # each engine's first join at start-up, as server/app.py waits for its engines
# The parent sees a child exit at once (its process sentinel) and has the controller check it then; the
# pings only find a child that hangs, so they can be rarer than on Ray (each costs both sides ~1 ms of CPU)
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 2.0

CONTROLLER_METHODS = (
    "register_replica",
    "deregister_replica",
    "previous_url",
    "next_view",
    "view",
    "add_engine",
    "remove_engine",
    "suspect",
    "operate",
)
REPLICA_METHODS = ("ping", "joined", "operate", "replicate", "copies_for")


def serve_processes(settings: GatewaySettings) -> int:
    """Serve until SIGTERM/SIGINT (module docstring); the exit status."""
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve(settings))


@dataclass(eq=False)
class _Child:
    replica_id: str
    process: BaseProcess
    link: Connection  # the parent's end of a pipe: the child's URL comes on it; its EOF tells the child
    url: asyncio.Future[str]  # once the child serves
    exited: asyncio.Future[int | None]  # once the process ends: its exit status


@dataclass(eq=False)
class _Children:
    """The parent's children: start, watch and respawn, stop."""

    settings: GatewaySettings  # each child's: no engines of its own, a private port the OS picks
    controller_path: str
    sockets: Path
    shared_port: int
    # the gateway's identity in `/health`, every child's alike (miles reads it as its session server's)
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    children: dict[str, _Child] = field(default_factory=dict)

    def spawn(self, replica_id: str) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe(duplex=True)
        spec = _ChildSpec(
            replica_id, self.settings, self.controller_path, self.sockets, self.shared_port, self.instance_id
        )
        process = context.Process(target=_child_main, args=(spec, theirs), name=replica_id)
        process.start()
        theirs.close()  # the child holds its own end
        loop = asyncio.get_running_loop()
        child = _Child(replica_id, process, ours, loop.create_future(), loop.create_future())

        def on_message() -> None:  # one message, the URL; or EOF, if the child exited first
            loop.remove_reader(ours.fileno())
            with contextlib.suppress(EOFError, OSError):
                child.url.set_result(ours.recv())

        def on_exit() -> None:  # its end of the sentinel closed as it exits; its status comes a moment later
            loop.remove_reader(process.sentinel)
            reaped = loop.run_in_executor(None, process.join)
            reaped.add_done_callback(lambda _: child.exited.set_result(process.exitcode))

        loop.add_reader(ours.fileno(), on_message)
        loop.add_reader(process.sentinel, on_exit)
        self.children[replica_id] = child

    async def started(self, stop: asyncio.Future[None], timeout_s: float = START_TIMEOUT_S) -> str | None:
        """Waits until every child serves; None, or why start-up failed (a child exited, it took too long, or
        `stop` came first)."""
        try:
            async with asyncio.timeout(timeout_s):
                while not all(c.url.done() for c in self.children.values()):  # each turn: one of them is done
                    waited: list[asyncio.Future[Any]] = [stop]
                    waited += [c.exited for c in self.children.values()]
                    waited += [c.url for c in self.children.values() if not c.url.done()]
                    await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
                    for child in self.children.values():
                        if child.exited.done():
                            status = child.exited.result()
                            return f"{child.replica_id} exited with status {status} before it served"
                    if stop.done():
                        return "stopped while starting"
        except TimeoutError:
            return f"the processes did not all serve within {timeout_s:g} s"
        return None

    async def watch(self, controller: FleetController) -> None:
        """Start a new incarnation of each child that exits while the gateway serves (its lifetime)."""
        while True:
            exits = {c.exited: c for c in self.children.values()}
            done, _ = await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
            for exited in done:
                child = exits[exited]
                log.warning(
                    "%s (pid %s) exited with status %s; a new one starts in %g s",
                    child.replica_id,
                    child.process.pid,
                    exited.result(),
                    RESPAWN_DELAY_S,
                )
                child.link.close()
                await controller.suspect(child.replica_id)  # its socket refuses: its engines move now
                await asyncio.sleep(RESPAWN_DELAY_S)
                self.spawn(child.replica_id)

    def signal_all(self) -> None:
        for child in self.children.values():
            if not child.exited.done() and child.process.pid is not None:
                # reaped a moment before its `exited` is set (on_exit): nothing left to signal
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGTERM)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM each child (its graceful shutdown), SIGKILL what is left after the grace."""
        self.signal_all()
        if self.children:
            await asyncio.wait([c.exited for c in self.children.values()], timeout=grace_s + STOP_MARGIN_S)
        for child in self.children.values():
            if not child.exited.done():
                log.warning("%s did not stop in %g s: killed", child.replica_id, grace_s + STOP_MARGIN_S)
                child.process.kill()
            child.process.join()
            child.link.close()


async def _serve(settings: GatewaySettings) -> int:
    try:
        port_socket = _reserve(settings.host, settings.port)
    except OSError as exc:
        print(f"rolloutgate serve: cannot bind {settings.host}:{settings.port}: {exc}", flush=True)
        return 2
    with port_socket, tempfile.TemporaryDirectory(prefix="rolloutgate-") as folder:
        port: int = port_socket.getsockname()[1]
        async with _engines(settings) as engines:
            return await _run(settings, engines, port, Path(folder))


async def _run(settings: GatewaySettings, engines: list[EngineSpec], port: int, sockets: Path) -> int:
    peers = loopback.LoopbackPeers()
    controller = FleetController(
        [EngineEntry(url=e.url, family=e.family, capacity=e.capacity) for e in engines],
        link_factory=peers.replica,
        ping_interval_s=PING_INTERVAL_S,
        ping_timeout_s=PING_TIMEOUT_S,
        expected_replicas=settings.processes,
    )
    await controller.start()
    controller_path = sockets / "controller.sock"
    controller_server = await loopback.serve(controller_path, controller, CONTROLLER_METHODS)
    children = _Children(
        settings.model_copy(update={"port": 0, "engines": [], "sim": 0, "processes": 1}),
        str(controller_path),
        sockets,
        port,
    )
    # installed before the first child starts: a signal during start-up stops the children too
    stop = asyncio.create_task(until_stop_signal(children.signal_all), name="processes-stop")
    watcher: asyncio.Task[None] | None = None
    try:
        for index in range(settings.processes):
            children.spawn(f"replica-{index}")
        failed = await children.started(stop)
        if failed is not None:
            print(f"rolloutgate serve: {failed}", flush=True)
            return 1
        # as one gateway does before it says it serves: every engine joined its owner's pool or failed once
        # (bounded; one that cannot be reached stays registered and is tried again)
        await asyncio.gather(*(controller.owner_joined(e.url, FIRST_JOIN_S) for e in engines))
        watcher = asyncio.create_task(children.watch(controller), name="processes-watch")
        where = f"http://{settings.host}:{port}"
        print(f"rolloutgate serving on {where} from {settings.processes} processes", flush=True)
        # the first SIGTERM/SIGINT starts a graceful shutdown; each one after cuts the children's grace short
        await stop
        return 0
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await controller.close()  # its liveness checks end: no engine changes owner for a child that stops
        await children.stop(settings.shutdown_grace / settings.time_scale)
        await controller_server.cleanup()  # after the children: each one's last call is to leave the fleet
        await peers.close()
        print("rolloutgate stopped", flush=True)


def _reserve(host: str, port: int) -> socket.socket:
    """The shared port, held for the gateway's life: bound with SO_REUSEPORT, never listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.asynccontextmanager
async def _engines(settings: GatewaySettings) -> AsyncIterator[list[EngineSpec]]:
    """The engines the children share: `--engine`s, and with `--sim` simulated ones in the parent."""
    if not settings.sim:
        yield list(settings.engines)
        return
    from rolloutsim import SimCluster

    async with SimCluster(
        engines=settings.sim,
        api=settings.sim_api,
        profile=settings.sim_profile,
        time_scale=settings.time_scale,
        vocab_size=folder_vocab_size(settings.tokenizer) if settings.tokenizer else None,
        model_path=settings.tokenizer,
    ) as cluster:
        yield [*settings.engines, *(EngineSpec(url=url, family=settings.sim_api) for url in cluster.urls)]


# -- in each child -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ChildSpec:
    """What a child is started with (pickled to it by the spawn)."""

    replica_id: str
    settings: GatewaySettings
    controller_path: str
    sockets: Path
    shared_port: int
    instance_id: str


def _child_main(spec: _ChildSpec, link: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's to judge (module docstring)
    logging.basicConfig(
        level=spec.settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [{spec.replica_id}] %(message)s",
    )
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(_replica(spec, link))


async def _replica(spec: _ChildSpec, link: Connection) -> None:
    replica_id = spec.replica_id
    peers = loopback.LoopbackPeers()
    controller = loopback.LoopbackTransport(spec.controller_path)
    replica = FleetReplica(
        replica_id,
        spec.settings,
        ControllerClient(controller),
        peer_link=peers.replica,
        shared_port=spec.shared_port,
        instance_id=spec.instance_id,
    )
    path = spec.sockets / f"{replica_id}-{replica.incarnation[:12]}.sock"  # a new incarnation, a new path
    replica.handle = str(path)
    started = asyncio.Event()
    server = await loopback.serve(path, replica, REPLICA_METHODS, ready=started)
    try:
        url = await replica.start()
        started.set()
        tune_gc()
        keep_large_buffers_returnable()
        link.send(url)

        def hurry() -> None:
            if replica.server is not None:
                replica.server.hurry()

        loop = asyncio.get_running_loop()
        orphaned = loop.create_future()  # the parent's end of the link closed: it is gone (killed)

        def parent_gone() -> None:
            if not orphaned.done():
                orphaned.set_result(None)

        loop.add_reader(link.fileno(), parent_gone)
        stopped = asyncio.create_task(until_stop_signal(hurry, signals=(signal.SIGTERM,)))
        await asyncio.wait([stopped, orphaned], return_when=asyncio.FIRST_COMPLETED)
        loop.remove_reader(link.fileno())
        if orphaned.done():
            log.warning("%s: the parent process is gone; stopping", replica_id)
        await replica.stop()
    finally:
        await server.cleanup()
        await peers.close()
        await controller.close()
