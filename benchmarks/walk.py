"""How far one request walks through the gateway's code (docs/DESIGN.md, "Three walks").

Starts a simulated SGLang engine and a gateway in this process, sends each walk once to warm up, then again
under a profile hook that records every call into a rolloutgate function (the simulator is the sibling package
rolloutsim): the distinct functions ("stays"), the files they live in ("rooms") and the calls made. The package's
compiled modules are bypassed (their calls are invisible to a profile hook), so the interpreted code is what is
counted. What the engines' health loops and the engine-level progress watch call meanwhile is left out
(`BACKGROUND`): they run per engine on their own schedule, so their share of a walk was a matter of timing. So
is what the simulator's own code calls of rolloutgate's (the clock it shares, runtime_clock.LoopClock): the
engine's work, and its health probes' share a matter of timing too.

The third walk, a fleet forward, needs a fleet: two replicas and their controller in this process, linked
directly (no Ray; as tests/fleet/local_fleet.py does), over two simulated engines. A keyed /generate sent to
the replica that does not own its key is forwarded one hop to the owner, whose gateway takes walk 1: both
replicas live here, so the walk counts both sides. The fleet's own loops (the controller's pings, each
replica's follower of its view) are left out as the health loops are.

    .venv/bin/python -m benchmarks.walk            # the walks: a whole /generate, a session turn, a forward
    .venv/bin/python -m benchmarks.walk --list     # and each walk's functions, in first-call order
    PYTHONPATH=<old checkout>/src .venv/bin/python -m benchmarks.walk   # an older commit's walks
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any


class _SourceOnly(importlib.abc.MetaPathFinder):
    """Imports rolloutgate's modules from their sources even where a compiled module sits beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("rolloutgate."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or spec.origin.endswith(".py"):
            return spec
        source = Path(spec.origin).with_name(fullname.rsplit(".", 1)[-1] + ".py")
        loader = importlib.machinery.SourceFileLoader(fullname, str(source))
        return importlib.util.spec_from_file_location(fullname, source, loader=loader)


sys.meta_path.insert(0, _SourceOnly())

import httpx  # noqa: E402

import rolloutgate  # noqa: E402
from rolloutgate.config import EngineSpec, GatewaySettings  # noqa: E402
from rolloutgate.fleet.assignment import EngineEntry, FleetView  # noqa: E402
from rolloutgate.fleet.controller import FleetController  # noqa: E402
from rolloutgate.fleet.links import JoinResult, SessionChange  # noqa: E402
from rolloutgate.fleet.operations import ReplicaResult  # noqa: E402
from rolloutgate.fleet.replica import FleetReplica  # noqa: E402
from rolloutgate.fleet.routing import VIA_HEADER  # noqa: E402
from rolloutgate.server.app import GatewayServer  # noqa: E402
from rolloutgate.sessions.registry import SessionCopy  # noqa: E402

try:
    from rolloutsim import SimCluster
except ImportError:  # a checkout from before the simulator left the package (`PYTHONPATH=<old>/src`)
    from rolloutgate.sim import SimCluster  # type: ignore[import-not-found,no-redef]

assert rolloutgate.__file__ is not None
PACKAGE = Path(rolloutgate.__file__).parent
NOT_THE_GATEWAY = (PACKAGE / "sim", PACKAGE / "bench")  # where an old checkout kept the simulator, benchmarks
# The engines' health loops and the engine-level progress watch run on their own schedule, per engine, whatever
# the calls: what they call while a walk is recorded is not the request's walk. So do the fleet's: the
# controller's liveness round and each ping it spawns (a task of its own), and each replica's long poll of the
# controller's view.
BACKGROUND = frozenset(
    {
        "EngineHealth.loop",
        "EnginePool._health_loop",
        "EngineWatcher._poll",
        "FleetController._watch",
        "FleetController._check",
        "FleetReplica._follow",
    }
)
# the simulator's code (rolloutsim, or rolloutgate/sim in an old checkout): what it calls is the engine's work
SIMULATOR = tuple(
    f"{folder}{os.sep}" for folder in {Path(inspect.getfile(SimCluster)).parent, PACKAGE / "sim"}
)
REPLICAS = 2  # one that forwards, one that owns the key
ROUTING_KEY = "X-SMG-Routing-Key"


def _off_the_walk(frame: FrameType | None) -> bool:
    """Whether a call was made by a background loop, or by the simulator (the engine's own reads of the clock
    it shares with the gateway, runtime_clock.LoopClock)."""
    while frame is not None:
        code = frame.f_code
        if code.co_qualname in BACKGROUND or code.co_filename.startswith(SIMULATOR):
            return True
        frame = frame.f_back
    return False


class Walk:
    """The rolloutgate functions called while it is on, in first-call order, with their call counts."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}

    def _hook(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if PACKAGE not in path.parents or any(part in path.parents for part in NOT_THE_GATEWAY):
            return  # the simulator (rolloutsim, beside it) is the engine, not the gateway
        if _off_the_walk(frame):
            return
        key = (str(path.relative_to(PACKAGE.parent)), frame.f_code.co_qualname)
        self.calls[key] = self.calls.get(key, 0) + 1

    async def record(self, step: Callable[[], Awaitable[None]]) -> None:
        sys.setprofile(self._hook)
        try:
            await step()
        finally:
            sys.setprofile(None)

    def summary(self) -> str:
        rooms = {path for path, _ in self.calls}
        return f"{len(self.calls)} functions in {len(rooms)} files, {sum(self.calls.values())} calls"


async def _walk(name: str, step: Callable[[], Awaitable[None]], show: bool) -> None:
    await step()  # warm: first-time paths (imports, pools, caches) are not the walk
    walk = Walk()
    await walk.record(step)
    print(f"{name}: {walk.summary()}")
    if show:
        for (path, function), count in walk.calls.items():
            print(f"    {path}:{function} x{count}")


async def gateway_walks(show: bool) -> None:
    """Walks 1 and 2: one gateway over one simulated engine."""
    async with SimCluster(engines=1, api="sglang", profile="default", time_scale=100.0) as cluster:
        settings = GatewaySettings(
            host="127.0.0.1",
            port=0,
            engines=[EngineSpec(url=url, family="sglang") for url in cluster.urls],
            time_scale=cluster.time_scale,
            keepalive_interval=0,
        )
        gateway = GatewayServer(settings)
        await gateway.start()
        try:
            async with httpx.AsyncClient(timeout=60.0) as http:
                body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 8}}

                async def generate() -> None:
                    answer = await http.post(gateway.url + "/generate", json=body)
                    assert answer.status_code == 200, answer.text

                session_url = ""

                async def turn() -> None:
                    answer = await http.post(session_url + "/generate", json=body)
                    assert answer.status_code == 200, answer.text

                walks: list[tuple[str, Callable[[], Awaitable[None]]]] = [("a whole /generate", generate)]
                opened = await http.post(gateway.url + "/sessions")
                if opened.status_code == 200:
                    session_url = f"{gateway.url}/sessions/{opened.json()['session_id']}"
                    walks.append(("a session turn (/sessions/{id}/generate)", turn))
                for name, step in walks:
                    await _walk(name, step, show)
        finally:
            await gateway.stop()


@dataclasses.dataclass(eq=False)
class _Link:
    """The controller's (and a peer's) link to a replica in this process: its calls, made directly."""

    replica: FleetReplica | None = None

    def _it(self) -> FleetReplica:
        assert self.replica is not None, "linked before it registers"
        return self.replica

    async def ping(self, timeout_s: float) -> str:
        return await self._it().ping(timeout_s)

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        return await self._it().joined(url, version, timeout_s)

    async def operate(
        self, name: str, body: dict[str, Any], query: dict[str, str], timeout_s: float
    ) -> ReplicaResult:
        return await self._it().operate(name, body, query)

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        return await self._it().replicate(changes, timeout_s)

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        return await self._it().copies_for(replica_id, replicas, timeout_s)


def _link_of(handle: object) -> Any:  # a ReplicaLink: `Any` since the protocol's module moved over time
    assert isinstance(handle, _Link)
    return handle


def _all_joined(controller: FleetController, replicas: list[FleetReplica]) -> bool:
    view = controller.latest
    return all(
        r.server is not None
        and len(r.server.context.pool.engines) == len(view.engines_of(r.replica_id))
        and r.view.version == view.version
        for r in replicas
    )


def _key_owned_by(view: FleetView, replica_id: str, prefix: str) -> str:
    return next(k for k in (f"{prefix}{i}" for i in range(500)) if view.key_owner(k) == replica_id)


async def fleet_walk(show: bool) -> None:
    """Walk 3: a keyed /generate at replica-0 whose key replica-1 owns, forwarded one hop."""
    # the replicas' shared port (as a fleet on one node has): bound, not listening, held for the fleet's life
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as reservation:
        reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reservation.bind(("127.0.0.1", 0))
        shared_port: int = reservation.getsockname()[1]
        async with SimCluster(engines=REPLICAS, api="sglang", profile="default", time_scale=100.0) as cluster:
            controller = FleetController(
                [EngineEntry(url, family="sglang") for url in cluster.urls],
                link_factory=_link_of,
                ping_interval_s=0.1,
                expected_replicas=REPLICAS,
            )
            await controller.start()
            settings = GatewaySettings(port=0, time_scale=100.0, stall_timeout=600.0, log_level="warning")
            replicas: list[FleetReplica] = []
            try:
                for i in range(REPLICAS):
                    link = _Link()
                    replica = FleetReplica(
                        f"replica-{i}", settings, controller, handle=link, shared_port=shared_port
                    )
                    link.replica = replica
                    replicas.append(replica)
                    await replica.start()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 30.0
                while not _all_joined(controller, replicas):
                    assert loop.time() < deadline, "the fleet did not form in 30 s"
                    await asyncio.sleep(0.02)
                # the keys' owners found on a copy: the replicas hold the controller's view itself here, and
                # its cache of key owners would spare replica-0 the hash that a fresh key costs it
                view = dataclasses.replace(controller.latest)
                keys = iter([_key_owned_by(view, "replica-1", p) for p in ("warm-", "walk-")])
                url = replicas[0].url + "/generate"  # read before: the client's call, not the walk
                body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4}}
                async with httpx.AsyncClient(timeout=60.0) as http:

                    async def forwarded() -> None:
                        answer = await http.post(url, json=body, headers={ROUTING_KEY: next(keys)})
                        assert answer.status_code == 200, answer.text
                        assert answer.headers.get(VIA_HEADER) == "replica-0", "not forwarded"

                    await _walk("a fleet forward (replica-0 -> replica-1 /generate)", forwarded, show)
            finally:
                # each replica that stops "leaves" the fleet, which the controller warns of: expected here
                logging.getLogger("rolloutgate.fleet").setLevel(logging.ERROR)
                for replica in replicas:
                    await replica.stop(grace_s=0)
                await controller.close()


async def main(show: bool) -> None:
    await gateway_walks(show)
    await fleet_walk(show)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--list", action="store_true", help="each walk's functions, in first-call order")
    asyncio.run(main(parser.parse_args().list))
