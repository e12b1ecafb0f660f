"""A fleet of gateway replicas on Ray: each owns a shard of the engines; any replica takes any request.

Theory of operation (docs/fleet.md): a controller actor holds which replica owns which engine
(fleet/assignment.py, sans-IO) and the live replicas (fleet/controller.py, liveness from Ray itself); N replica
actors each run a production gateway (server/app.py) over their own engines (fleet/replica.py), and route
every request to the replica that owns its session or routing key, one hop at most (fleet/routing.py,
fleet/forward.py, fleet/edge.py). `start_fleet` (fleet/launch.py) and `rolloutgate fleet` (fleet/cli.py)
start one on Ray; `rolloutgate serve --processes N` (fleet/processes.py) starts one on a single host without
Ray, its links over Unix sockets (fleet/loopback.py). Ray is needed only to start a fleet on Ray
(`pip install 'rolloutgate[fleet]'`); the rest imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ("Fleet", "start_fleet")

if TYPE_CHECKING:
    from rolloutgate.fleet.launch import Fleet, start_fleet


def __getattr__(name: str) -> Any:
    if name in __all__:  # imports Ray: only when a fleet is started
        from rolloutgate.fleet import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
