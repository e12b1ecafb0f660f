"""Where a request that reached a replica is served: here, one hop away at its owner, or by the controller.

Theory of operation: a pure function of the request's method, path, routing key and forwarding mark, and of the
replica's `FleetView` (fleet/assignment.py). The HTTP edge (fleet/forward.py) asks it once per request and
carries out the answer.

- A request another replica forwarded (`X-Rolloutgate-Forwarded-By`) is served here, whatever this replica's
  view says: never a second hop (views of two replicas may differ for a moment after a change).
- Engine registration and the fleet-wide engine list (`/workers`, `/add_worker`, `/remove_worker`,
  `/list_workers`) go to the controller: an engine is registered once for the fleet, and gets one owner.
- `POST /sessions` creates the session at a replica picked by hashing a fresh nonce over the replicas that
  own engines (an even spread; the session id then names that replica, so its turns find it).
- A session's own paths (`/sessions/{id}...`) and the inference routes with a routing key go to the key's
  owner (`FleetView.key_owner`).
- `/finish_session?session_id=` (vllm-router's release of a session's binding) goes to the owner of that key,
  the replica whose core holds the binding.
- An inference call without a key is served here if this replica owns an engine (any replica accepts any
  request), else at a replica that does. `/ready` goes where such a call would: behind a shared port, a
  replica that owns no engine is still ready when the one it forwards to is.
- Engine control (`/admin/pause`, `/admin/resume`, `/admin/update_weights`, `/abort_request`, `/flush_cache`,
  `/engine_metrics`, the trainer's control plane `/v1/rl/...`, and with `?scope=fleet` `/admin/state` and
  `/metrics`) is for the whole fleet: this replica judges the caller's rights, and the controller runs it on
  every replica over Ray (fleet/operations.py), never over a hop.
- Everything else (`/admin/state`, `/metrics`, `/health`, the engine proxy) is served here. Only inference, session
  paths and `/finish_session` are ever forwarded: the owner judges the caller's rights by its address, which for a
  forwarded call is the forwarder's.
"""

from __future__ import annotations

from dataclasses import dataclass

from rolloutgate.fleet.assignment import FleetView

__all__ = (
    "FINISH_SESSION",
    "FLEET_READS",
    "FLEET_RL",
    "FLEET_WIDE",
    "FORWARDED_HEADER",
    "INFERENCE_PATHS",
    "READY",
    "REPLICA_HEADER",
    "REPLICA_URL_HEADER",
    "RL_PREFIX",
    "VIA_HEADER",
    "Decision",
    "FleetWide",
    "Forward",
    "Here",
    "ToController",
    "decide",
    "session_of_path",
)

FORWARDED_HEADER = "X-Rolloutgate-Forwarded-By"  # on a forwarded request: the forwarder's replica id
REPLICA_HEADER = "X-Rolloutgate-Replica"  # on every answer: the replica that served it
REPLICA_URL_HEADER = "X-Rolloutgate-Replica-Url"  # on every answer: that replica's base URL
VIA_HEADER = "X-Rolloutgate-Via"  # on a forwarded answer: the replica that forwarded it

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
FINISH_SESSION = "/finish_session"  # its key is the query's `session_id` (server/finish_session.py)
READY = "/ready"  # a load balancer's readiness probe of the URL it was sent to
REGISTRATION = frozenset(
    {
        ("POST", "/workers"),
        ("GET", "/workers"),
        ("POST", "/add_worker"),
        ("POST", "/remove_worker"),
        ("GET", "/list_workers"),
    }
)
_SESSIONS = "/sessions"
# engine control for the whole fleet (fleet/operations.py runs them): (method, path) -> operation name
FLEET_WIDE = {
    ("POST", "/admin/pause"): "pause",
    ("POST", "/admin/resume"): "resume",
    ("POST", "/admin/update_weights"): "update_weights",
    ("POST", "/abort_request"): "abort_request",
    ("GET", "/flush_cache"): "flush_cache",
    ("POST", "/flush_cache"): "flush_cache",
    ("GET", "/engine_metrics"): "engine_metrics",
}
FLEET_RL = "rl"  # every route under `/v1/rl/` (server/rl_plane.py): one operation, the call inside it
RL_PREFIX = "/v1/rl/"
# `?scope=fleet` makes these reads of every replica: (method, path) -> operation name
FLEET_READS = {("GET", "/admin/state"): "state", ("GET", "/metrics"): "metrics"}


@dataclass(frozen=True, slots=True)
class Here:
    """Serve it on this replica."""


@dataclass(frozen=True, slots=True)
class Forward:
    """Forward it, once, to `replica_id` at `url`."""

    replica_id: str
    url: str


@dataclass(frozen=True, slots=True)
class ToController:
    """Engine registration or the fleet-wide engine list: fleet/registration.py asks the controller."""


@dataclass(frozen=True, slots=True)
class FleetWide:
    """Engine control for the whole fleet: operation `name` on every replica, through the controller."""

    name: str


Decision = Here | Forward | ToController | FleetWide
HERE = Here()
TO_CONTROLLER = ToController()


def session_of_path(path: str) -> str | None:
    """`abc` for `/sessions/abc` and `/sessions/abc/...`; None for `/sessions` or any other path."""
    if not path.startswith(_SESSIONS + "/"):
        return None
    session_id = path[len(_SESSIONS) + 1 :].partition("/")[0]
    return session_id or None


def _to(view: FleetView, replica_id: str | None, self_id: str) -> Decision:
    if replica_id is None or replica_id == self_id:
        return HERE
    url = view.url_of(replica_id)
    return HERE if url is None else Forward(replica_id, url)


def decide(
    method: str,
    path: str,
    *,
    routing_key: str | None,
    forwarded_by: str | None,
    view: FleetView,
    self_id: str,
    nonce: str,
    scope: str | None = None,
) -> Decision:
    """Where to serve one request (module docstring). `nonce`: unique per request, spreads the requests that
    have no key of their own (new sessions; keyless calls at a replica without engines). `scope`: the query's
    `scope` (`fleet` asks `/admin/state` of every replica)."""
    if (method, path) in REGISTRATION or (method == "DELETE" and path.startswith("/workers/")):
        return TO_CONTROLLER
    if forwarded_by:
        return HERE
    fleet_wide = FLEET_WIDE.get((method, path))
    if fleet_wide is not None:
        return FleetWide(fleet_wide)
    if path.startswith(RL_PREFIX):
        return FleetWide(FLEET_RL)
    if scope == "fleet" and (method, path) in FLEET_READS:
        return FleetWide(FLEET_READS[method, path])
    if path == _SESSIONS:
        if method != "POST":
            return HERE
        return _to(view, view.key_owner(nonce) if view.key_candidates else None, self_id)
    session_id = session_of_path(path)
    if session_id is not None:
        return _to(view, view.key_owner(session_id), self_id)
    if path == FINISH_SESSION:
        return _to(view, view.key_owner(routing_key), self_id) if routing_key else HERE
    if path == READY:  # can a call sent here be served: where a keyless call would be
        return _keyless(view, self_id, nonce)
    if path not in INFERENCE_PATHS:
        return HERE
    if routing_key:
        return _to(view, view.key_owner(routing_key), self_id)
    return _keyless(view, self_id, nonce)


def _keyless(view: FleetView, self_id: str, nonce: str) -> Decision:
    if self_id in view.key_candidates or not view.key_candidates:
        return HERE  # it owns engines (or nobody does, and the answer is the same everywhere)
    return _to(view, view.key_owner(nonce), self_id)
