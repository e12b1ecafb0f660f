"""What the controller and the replicas say to each other: the calls, their answers, their failures.

Theory of operation: the controller and the replicas are plain objects (fleet/controller.py,
fleet/replica.py) that talk through these two protocols, implemented once over any transport
(fleet/clients.py): on Ray each side holds the other's actor handle (fleet/handles.py); as processes of one
host, the path of the other's Unix socket (fleet/loopback.py); in one process (tests) each side holds the
other object itself. So everything but the transports is tested without Ray, and the transport's own liveness
(an actor that died, a socket that refuses: `final`) is the only membership signal there is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rolloutgate.fleet.assignment import EngineEntry, FleetView
from rolloutgate.sessions.record import TurnRecord
from rolloutgate.sessions.registry import SessionCopy

if TYPE_CHECKING:
    from rolloutgate.fleet.operations import ReplicaResult
    from rolloutgate.server.answer import Answer

__all__ = (
    "ControllerLink",
    "ControllerUnreachable",
    "EngineChange",
    "JoinResult",
    "ReplicaInfo",
    "ReplicaLink",
    "ReplicaUnreachable",
    "SessionChange",
    "SessionRemoved",
    "TurnChange",
)


class ReplicaUnreachable(Exception):
    """A replica did not answer: dead, restarting, or too slow. `final`: this incarnation will never answer
    again (it died; Ray may be starting a new one, which registers itself)."""

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


class ControllerUnreachable(Exception):
    """The controller did not answer (restarting, or gone with the fleet)."""


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    replica_id: str
    url: str
    incarnation: str  # unique per process: a restarted replica is a new incarnation of the same id


@dataclass(frozen=True, slots=True)
class JoinResult:
    """An owner's answer about one engine after a view change: joined its pool (`worker`: the pool's
    description), or not (`error`)."""

    ok: bool
    worker: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class EngineChange:
    """The controller's answer to an engine registration or removal."""

    ok: bool
    view: FleetView
    url: str
    owner: str | None = None
    worker: dict[str, Any] = field(default_factory=dict)  # the owner's description of it, when it joined
    error: str | None = None
    code: str | None = None  # why not: worker_unreachable, worker_not_found, no_replica


@dataclass(frozen=True, slots=True)
class TurnChange:
    """A turn a session's owner committed; `after`: the request id of its turn before it (None: the first)."""

    session_id: str
    record: TurnRecord
    after: str | None


@dataclass(frozen=True, slots=True)
class SessionRemoved:
    """A session its owner deleted or evicted."""

    session_id: str


# what a session's owner sends its backup (fleet/replication.py): a turn, a whole session, a removal
SessionChange = TurnChange | SessionCopy | SessionRemoved


class ReplicaLink(Protocol):
    """The controller's calls to a replica, and a replica's to its peers (the last two)."""

    async def ping(self, timeout_s: float) -> str:
        """The replica's incarnation. Raises ReplicaUnreachable."""
        ...

    async def joined(self, url: str, version: int, timeout_s: float) -> JoinResult:
        """Once the replica applied `version`: whether engine `url` joined its pool. Raises
        ReplicaUnreachable."""
        ...

    async def operate(
        self, name: str, body: dict[str, Any], query: dict[str, str], timeout_s: float
    ) -> ReplicaResult:
        """Run fleet-wide operation `name` on the replica's gateway (fleet/operations.py). Raises
        ReplicaUnreachable."""
        ...

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        """Apply a peer's session changes; returns the sessions it wants whole. Raises ReplicaUnreachable."""
        ...

    async def copies_for(
        self, replica_id: str, replicas: Sequence[str], timeout_s: float
    ) -> list[SessionCopy]:
        """The copies this replica holds of `replica_id`'s sessions (fleet/replication.py). Raises
        ReplicaUnreachable."""
        ...


class ControllerLink(Protocol):
    """A replica's calls to the controller. Each raises ControllerUnreachable."""

    async def register_replica(
        self, info: ReplicaInfo, handle: object, engines: Sequence[EngineEntry]
    ) -> FleetView: ...

    async def deregister_replica(self, replica_id: str, incarnation: str) -> FleetView: ...

    async def previous_url(self, replica_id: str) -> str | None: ...

    async def next_view(self, after_version: int, timeout_s: float, epoch: str) -> FleetView: ...

    async def view(self) -> FleetView: ...

    async def add_engine(self, entry: EngineEntry, wait_s: float) -> EngineChange: ...

    async def remove_engine(self, ref: str) -> EngineChange: ...

    async def suspect(self, replica_id: str) -> None: ...

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> Answer: ...
