"""fleet/routing.py: where each request is served (here, one hop to its owner, or through the controller),
from the request and the replica's view alone. Pure: no Ray, no sockets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.fleet.assignment import Assignment, EngineEntry, FleetView, mint_session_id
from rolloutgate.fleet.routing import (
    FLEET_WIDE,
    Decision,
    FleetWide,
    Forward,
    Here,
    ToController,
    decide,
    session_of_path,
)

REPLICAS = ["replica-0", "replica-1", "replica-2"]


def fleet_view(engines: int = 6, replicas: list[str] = REPLICAS) -> FleetView:
    assignment = Assignment()
    for replica in replicas:
        assignment.add_replica(replica)
    urls = [f"http://127.0.0.1:{31000 + i}" for i in range(engines)]
    for url in urls:
        assignment.add_engine(url)
    return FleetView.of(
        assignment,
        epoch="e",
        version=1,
        urls={r: f"http://127.0.0.1:{8000 + i}" for i, r in enumerate(replicas)},
        engines={u: EngineEntry(u) for u in urls},
        incarnations={},
    )


VIEW = fleet_view()


def where(
    method: str,
    path: str,
    *,
    key: str | None = None,
    forwarded: str | None = None,
    me: str = "replica-0",
    view: FleetView = VIEW,
    nonce: str = "n0",
    scope: str | None = None,
) -> Decision:
    return decide(
        method, path, routing_key=key, forwarded_by=forwarded, view=view, self_id=me, nonce=nonce, scope=scope
    )


@given(st.text(min_size=1, max_size=30), st.sampled_from(REPLICAS))
def test_a_keyed_call_is_served_by_the_keys_owner_from_any_replica(key: str, me: str) -> None:
    owner = VIEW.key_owner(key)
    decision = where("POST", "/generate", key=key, me=me)
    if owner == me:
        assert decision == Here()
    else:
        assert decision == Forward(owner or "", VIEW.replicas[owner or ""])


@given(st.text(min_size=1, max_size=30), st.sampled_from(REPLICAS))
def test_a_sessions_finish_goes_where_its_calls_went(key: str, me: str) -> None:
    """`/finish_session?session_id=K` (the edge passes K as the key) reaches the replica whose core holds K's
    binding: the one its keyed calls are served by; without an id it is answered here (a 400)."""
    assert where("POST", "/finish_session", key=key, me=me) == where("POST", "/generate", key=key, me=me)
    assert where("POST", "/finish_session", me=me) == Here()


@given(st.text(min_size=1, max_size=30), st.sampled_from(REPLICAS), st.sampled_from(REPLICAS))
def test_a_forwarded_request_is_never_forwarded_again(key: str, me: str, forwarder: str) -> None:
    for path in (
        "/generate",
        "/v1/chat/completions",
        f"/sessions/{key.replace('/', '')}x/v1/chat/completions",
    ):
        assert where("POST", path, key=key, forwarded=forwarder, me=me) == Here()


def test_a_sessions_paths_go_to_the_replica_its_id_names() -> None:
    session_id = mint_session_id("replica-2", "ab" * 16)
    for method, path in [
        ("POST", f"/sessions/{session_id}/v1/chat/completions"),
        ("GET", f"/sessions/{session_id}"),
        ("DELETE", f"/sessions/{session_id}"),
        ("POST", f"/sessions/{session_id}/samples"),
        ("POST", f"/sessions/{session_id}/generate"),
    ]:
        assert where(method, path) == Forward("replica-2", VIEW.replicas["replica-2"])
        assert where(method, path, me="replica-2") == Here()


def test_new_sessions_spread_over_the_replicas() -> None:
    targets = set()
    for i in range(60):
        decision = where("POST", "/sessions", nonce=f"replica-0:{i}")
        assert isinstance(decision, Here | Forward)
        targets.add(decision.replica_id if isinstance(decision, Forward) else "replica-0")
    assert targets == set(REPLICAS)
    assert where("GET", "/sessions") == Here()


def test_a_keyless_call_stays_here_unless_this_replica_owns_no_engine() -> None:
    assert where("POST", "/v1/chat/completions") == Here()
    few = fleet_view(engines=1)  # replica-0 owns the only engine
    assert where("POST", "/generate", me="replica-0", view=few) == Here()
    assert where("POST", "/generate", me="replica-1", view=few) == Forward(
        "replica-0", few.replicas["replica-0"]
    )
    none = fleet_view(engines=0)
    assert where("POST", "/generate", me="replica-1", view=none) == Here()


def test_readiness_is_asked_where_a_keyless_call_would_be_served() -> None:
    few = fleet_view(engines=1)  # replica-0 owns the only engine
    assert where("GET", "/ready", me="replica-0", view=few) == Here()
    assert where("GET", "/ready", me="replica-1", view=few) == Forward("replica-0", few.replicas["replica-0"])
    assert where("GET", "/ready", me="replica-1", view=fleet_view(engines=0)) == Here()
    assert where("GET", "/health", me="replica-1", view=few) == Here(), "liveness is this process's own"


def test_registration_goes_to_the_controller_and_control_is_never_forwarded() -> None:
    for method, path in [
        ("POST", "/workers"),
        ("GET", "/workers"),
        ("DELETE", "/workers/e-abc"),
        ("POST", "/add_worker"),
        ("POST", "/remove_worker"),
        ("GET", "/list_workers"),
    ]:
        assert where(method, path) == ToController()
        assert where(method, path, forwarded="replica-1") == ToController()
    key = next(k for k in (f"k{i}" for i in range(100)) if VIEW.key_owner(k) != "replica-0")
    for method, path in [
        ("GET", "/admin/state"),
        ("POST", "/pause_generation"),
        ("GET", "/metrics"),
        ("GET", "/health"),
    ]:
        assert where(method, path, key=key) == Here(), path


def test_engine_control_is_for_the_whole_fleet_through_the_controller_never_a_hop() -> None:
    key = next(k for k in (f"k{i}" for i in range(100)) if VIEW.key_owner(k) != "replica-0")
    for (method, path), name in FLEET_WIDE.items():
        assert where(method, path, key=key) == FleetWide(name), path
        assert where(method, path, forwarded="replica-1") == Here()  # a forwarded one is this replica's own
    assert where("GET", "/admin/state", scope="fleet") == FleetWide("state")
    assert where("GET", "/metrics", scope="fleet") == FleetWide("metrics")
    assert where("GET", "/admin/state", scope="replica") == Here()
    assert where("POST", "/admin/state", scope="fleet") == Here()  # not a read: the gateway's own 405
    assert {"pause", "resume", "update_weights", "abort_request", "flush_cache"} <= set(FLEET_WIDE.values())


def test_the_trainers_control_plane_is_one_fleet_wide_operation_whatever_its_route() -> None:
    for method, path in [
        ("GET", "/v1/rl/workers"),
        ("GET", "/v1/rl/workers/e-0123"),
        ("POST", "/v1/rl/workers/e-0123/engine/pause_generation"),
        ("POST", "/v1/rl/engine/update_weights_from_disk"),
        ("DELETE", "/v1/rl/nowhere"),  # no route: the composed answer says so (404), as one gateway's
    ]:
        assert where(method, path, key="k1") == FleetWide("rl"), path
    assert where("GET", "/v1/rlx", key="k1") == Here()


def test_session_of_path() -> None:
    assert session_of_path("/sessions/abc") == "abc"
    assert session_of_path("/sessions/abc/v1/chat/completions") == "abc"
    assert session_of_path("/sessions") is None
    assert session_of_path("/sessions/") is None
    assert session_of_path("/sessionsx/abc") is None


def test_an_owner_missing_from_the_view_means_here() -> None:
    lonely = fleet_view(replicas=["replica-0"])
    assert where("POST", "/generate", key="anything", view=lonely) == Here()
    session_id = mint_session_id("replica-9", "cd" * 16)  # a replica that is gone: hashed like any key
    assert where("GET", f"/sessions/{session_id}", view=lonely) == Here()
