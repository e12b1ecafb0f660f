"""Ray actor handles as a transport of fleet/clients.py: the fleet's links over Ray.

Theory of operation: a Ray actor handle's methods are untyped (`handle.method.remote(...)` is an awaitable
ObjectRef of Any); fleet/clients.py types each call once, for every transport. Ray's liveness is what this
transport reports: an actor that died raises `ActorDiedError`, one that Ray is restarting
`ActorUnavailableError` (both: this incarnation is gone, `LinkGone`).
"""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rolloutgate.fleet.clients import ControllerClient, LinkGone, ReplicaClient

__all__ = ("RayTransport", "controller_client", "current_actor", "node_ip_address", "replica_client")

_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


class RayTransport:
    """Calls on a Ray actor handle (fleet/clients.py Transport)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle  # a Ray ActorHandle of fleet/actors.py

    async def call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle, method).remote(*args)
        except _GONE as exc:
            raise LinkGone(type(exc).__name__) from None


def replica_client(handle: Any) -> ReplicaClient:
    """The link to a replica actor from its handle (the controller's `link_factory`, a replica's `peer_link`)."""
    return ReplicaClient(RayTransport(handle))


def controller_client(handle: Any) -> ControllerClient:
    return ControllerClient(RayTransport(handle))


def current_actor() -> Any:
    """The handle of the actor this code runs in (what a replica registers with)."""
    return ray.get_runtime_context().current_actor


def node_ip_address() -> str:
    """This node's IP as Ray knows it (where other nodes reach its replicas)."""
    # untyped in Ray; `unused-ignore`: `make lint` also checks this without Ray installed (pyproject.toml)
    address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call, unused-ignore]
    return address
