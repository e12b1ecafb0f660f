"""Start a fleet from Python: `start_fleet(...) -> Fleet`, for `rolloutgate fleet` and a framework's own Ray
driver alike.

Theory of operation: joins the Ray cluster the caller is in (or `address`, or starts a local one), creates
the controller actor with the engines given, then N replica actors spread over the nodes, and waits until
each serves. Every actor is named `<name>-controller` / `<name>-replica-<i>` in the Ray namespace, and owned
by this driver: they end with it (or with `Fleet.stop()`). Replicas restart under Ray's restart policy
(`max_restarts`, default: always) and register again by themselves; the controller too, in a new epoch.

Blocking calls (`ray.get`), as a Ray driver makes them; from async code, run it in a thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.fleet.actors import ControllerActor, ReplicaActor
from rolloutgate.fleet.assignment import EngineEntry, FleetView

__all__ = ("Fleet", "start_fleet")

log = logging.getLogger("rolloutgate.fleet")

START_TIMEOUT_S = 120.0  # an actor's start: a worker process, the gateway's imports, a bind


@dataclass(eq=False)
class Fleet:
    """A running fleet. `urls[i]` serves replica i; `url` is the one URL: the shared port on replica 0's node
    when the fleet has one (every replica on that node answers it, so it outlives any one of them), else
    replica 0's own (any replica takes any request, so a client may use any of them)."""

    name: str
    controller: Any  # Ray ActorHandle of fleet/actors.py ControllerActor
    replicas: dict[str, Any]  # replica id -> Ray ActorHandle of ReplicaActor
    urls: list[str] = field(default_factory=list)
    shared_port: int | None = None

    @property
    def url(self) -> str:
        if self.shared_port is None:
            return self.urls[0]
        return self.urls[0].rsplit(":", 1)[0] + f":{self.shared_port}"

    def view(self) -> FleetView:
        """The controller's view now: live replicas and their URLs, every engine and its owner."""
        view: FleetView = ray.get(self.controller.view.remote(), timeout=30)
        return view

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each live replica's own account (URL, pid, node, engines in its pool)."""
        refs = {rid: handle.describe.remote() for rid, handle in self.replicas.items()}
        out: dict[str, dict[str, Any]] = {}
        for rid, ref in refs.items():
            try:
                out[rid] = ray.get(ref, timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                out[rid] = {"replica_id": rid, "error": type(exc).__name__}
        return out

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the controller (so that no engine changes hands while the fleet stops), then every replica
        (each one's graceful shutdown, `grace_s` for its in-flight requests); bounded."""
        ray.kill(self.controller, no_restart=True)
        refs = {rid: handle.stop.remote(grace_s) for rid, handle in self.replicas.items()}
        deadline = time.monotonic() + grace_s + 30
        for rid, ref in refs.items():  # each on its own: one dead replica does not cut the others' grace
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("fleet %s: %s did not stop cleanly (%s)", self.name, rid, type(exc).__name__)
        for handle in self.replicas.values():
            ray.kill(handle, no_restart=True)


def _entries(engines: Iterable[str | EngineSpec | EngineEntry]) -> list[EngineEntry]:
    out = []
    for engine in engines:
        if isinstance(engine, EngineEntry):
            out.append(engine)
            continue
        spec = EngineSpec.parse(engine) if isinstance(engine, str) else engine
        out.append(EngineEntry(url=spec.url, family=spec.family, capacity=spec.capacity))
    return out


def start_fleet(
    replicas: int = 2,
    engines: Iterable[str | EngineSpec | EngineEntry] = (),
    settings: GatewaySettings | None = None,
    *,
    name: str = "rolloutgate",
    address: str | None = None,
    namespace: str | None = None,
    base_port: int = 0,
    shared_port: int | None = None,
    advertise_node_ip: bool | None = None,
    replica_num_cpus: float = 1.0,
    max_restarts: int = -1,
    ping_interval_s: float = 0.5,
    ping_timeout_s: float = 1.0,
    ping_failures: int = 2,
    ray_init: dict[str, Any] | None = None,
) -> Fleet:
    """Start a controller and `replicas` gateway replicas (module docstring); returns once each serves.

    `settings`: the gateway settings every replica runs with (its host; its port is `base_port + i`, or any
    free one with 0); engines come from `engines` and later registrations, never from `settings`.
    `shared_port`: every replica also listens there (SO_REUSEPORT), the fleet's one URL on each node.
    `advertise_node_ip`: put the node's IP in each replica's URL (default: when binding all addresses).
    `address`/`ray_init`: for `ray.init` when this process is not in a Ray cluster yet."""
    if replicas < 1:
        raise ValueError(f"a fleet has at least one replica, got {replicas}")
    base = settings or GatewaySettings()
    if base.sim or base.engines:
        raise ValueError("fleet engines are given to start_fleet (or registered later), not in settings")
    if not ray.is_initialized():
        options = {"include_dashboard": False, **(ray_init or {})}
        ray.init(address=address, namespace=namespace, **options)
    controller: Any = ControllerActor.options(
        name=f"{name}-controller", num_cpus=0, max_restarts=max_restarts, max_concurrency=10_000
    ).remote(_entries(engines), ping_interval_s, ping_timeout_s, ping_failures, replicas)
    ray.get(controller.ready.remote(), timeout=START_TIMEOUT_S)
    wildcard = base.host in ("0.0.0.0", "::")
    advertise = advertise_node_ip if advertise_node_ip is not None else wildcard
    handles: dict[str, Any] = {}
    for index in range(replicas):
        replica_id = f"replica-{index}"
        replica_settings = base.model_copy(update={"port": base_port + index if base_port else 0})
        handles[replica_id] = ReplicaActor.options(
            name=f"{name}-{replica_id}",
            num_cpus=replica_num_cpus,
            max_restarts=max_restarts,
            scheduling_strategy="SPREAD",
        ).remote(
            replica_id, replica_settings, f"{name}-controller", "node" if advertise else None, shared_port
        )
    fleet = Fleet(name=name, controller=controller, replicas=handles, shared_port=shared_port)
    try:
        fleet.urls = ray.get([h.ready.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    except BaseException:
        fleet.stop(grace_s=0)
        raise
    return fleet
