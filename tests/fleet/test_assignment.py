"""fleet/assignment.py: engine ownership (exactly one live owner, sticky, balanced within one, as few moves as
balance needs) and key ownership (rendezvous: only a departed replica's keys move), over random histories of
replicas and engines coming and going. Sans-IO: no Ray, in the default suite."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rolloutgate.fleet.assignment as assignment_module
from rolloutgate.fleet.assignment import (
    Assignment,
    EngineEntry,
    FleetView,
    Move,
    engine_fleet_id,
    mint_session_id,
    named_replica,
    rendezvous_owner,
)

REPLICAS = [f"replica-{i}" for i in range(6)]
ENGINES = [f"http://10.0.0.{i}:30000" for i in range(24)]

events = st.lists(
    st.one_of(
        st.tuples(st.just("add_replica"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("remove_replica"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("add_engine"), st.sampled_from(ENGINES)),
        st.tuples(st.just("remove_engine"), st.sampled_from(ENGINES)),
    ),
    max_size=60,
)


def minimal_balance_moves(loads: dict[str, int]) -> int:
    """The fewest engine moves that bring `loads` within one of each other: the most loaded replicas keep
    the ceil share."""
    total, count = sum(loads.values()), len(loads)
    if count == 0:
        return 0
    low, extra = divmod(total, count)
    targets = [low + 1] * extra + [low] * (count - extra)
    ordered = sorted(loads.values(), reverse=True)
    return sum(max(0, have - want) for have, want in zip(ordered, targets, strict=True))


def check_invariants(assignment: Assignment) -> None:
    live = set(assignment.replicas)
    owned = [e for r in assignment.replicas for e in assignment.engines_of(r)]
    assert sorted(owned) == sorted(set(owned)), "an engine has two owners"
    if live:
        assert sorted(owned) == sorted(assignment.engines), "an engine has no live owner"
        for engine in assignment.engines:
            assert assignment.owner(engine) in live
        loads = assignment.loads().values()
        assert max(loads) - min(loads) <= 1, "loads differ by more than one"
    else:
        assert all(assignment.owner(e) is None for e in assignment.engines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_every_engine_has_exactly_one_live_owner_and_loads_stay_within_one(
    history: list[tuple[str, str]],
) -> None:
    assignment = Assignment()
    for kind, name in history:
        getattr(assignment, kind)(name)
        check_invariants(assignment)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_an_engine_keeps_its_owner_but_for_the_fewest_moves_balance_needs(
    history: list[tuple[str, str]],
) -> None:
    assignment = Assignment()
    for kind, name in history:
        before = {e: assignment.owner(e) for e in assignment.engines}
        live_before = set(assignment.replicas)
        loads_before = assignment.loads()
        moves: list[Move] = getattr(assignment, kind)(name)
        live_after = set(assignment.replicas)
        # moves report every change of owner, and only those
        changed = {e for e in set(before) | set(assignment.engines) if before.get(e) != assignment.owner(e)}
        assert {m.engine for m in moves} >= changed
        # an engine whose owner lives on keeps it, except for balance moves between two live replicas
        rebalanced = [
            e
            for e, owner in before.items()
            if owner in live_after and e in assignment.engines and assignment.owner(e) != owner
        ]
        if kind == "add_replica" and name not in live_before:
            assert len(rebalanced) == minimal_balance_moves({**loads_before, name: 0})
        elif kind == "remove_engine" and name in before:
            assert len(rebalanced) <= 1
        else:  # a replica left, an engine came: the newcomers fill the least loaded; nobody else moves
            assert rebalanced == []
        if kind == "remove_replica" and name in live_before:
            for engine, owner in before.items():
                if owner == name and live_after:
                    assert assignment.owner(engine) in live_after


def test_a_returning_replica_takes_its_fair_share_and_nothing_more() -> None:
    assignment = Assignment()
    for replica in REPLICAS[:3]:
        assignment.add_replica(replica)
    for engine in ENGINES[:6]:
        assignment.add_engine(engine)
    assert assignment.loads() == {"replica-0": 2, "replica-1": 2, "replica-2": 2}
    kept = {e: assignment.owner(e) for e in ENGINES[:6]}
    moves = assignment.remove_replica("replica-2")
    assert sorted(m.source for m in moves) == ["replica-2", "replica-2"]
    assert assignment.loads() == {"replica-0": 3, "replica-1": 3}
    assert all(assignment.owner(e) == kept[e] for e in kept if kept[e] != "replica-2")
    back = assignment.add_replica("replica-2")
    assert len(back) == 2 and {m.target for m in back} == {"replica-2"}
    assert assignment.loads() == {"replica-0": 2, "replica-1": 2, "replica-2": 2}


def test_engines_wait_without_owner_while_no_replica_lives() -> None:
    assignment = Assignment()
    assert assignment.add_engine(ENGINES[0]) == []
    assert assignment.owner(ENGINES[0]) is None
    assert assignment.add_replica("replica-0") == [Move(ENGINES[0], None, "replica-0")]
    assert assignment.remove_replica("replica-0") == [Move(ENGINES[0], "replica-0", None)]


def test_a_preferred_owner_keeps_its_engine_when_balance_allows() -> None:
    assignment = Assignment()
    assignment.add_replica("replica-0")
    assignment.add_replica("replica-1")
    assignment.add_engine(ENGINES[0], prefer="replica-1")
    assert assignment.owner(ENGINES[0]) == "replica-1"
    assignment.add_engine(ENGINES[1], prefer="replica-1")
    assignment.add_engine(ENGINES[2], prefer="replica-1")  # 3 vs 0: balance moves one
    assert assignment.loads() == {"replica-0": 1, "replica-1": 2}


keys = st.lists(st.text(min_size=1, max_size=24), min_size=1, max_size=80, unique=True)
memberships = st.lists(st.sampled_from(REPLICAS), min_size=1, max_size=6, unique=True)


@settings(max_examples=200, deadline=None)
@given(keys, memberships, st.sampled_from(REPLICAS))
def test_key_ownership_moves_only_for_a_departed_replicas_keys(
    key_list: list[str], members: list[str], changed: str
) -> None:
    before = {k: rendezvous_owner(k, members) for k in key_list}
    assert all(owner in members for owner in before.values())
    if changed in members:  # it leaves: only its keys move
        after_members = [m for m in members if m != changed]
        for key, owner in before.items():
            after = rendezvous_owner(key, after_members)
            if owner != changed:
                assert after == owner
            else:
                assert after in after_members or not after_members
    else:  # it joins: a key keeps its owner or moves to the newcomer
        after_members = [*members, changed]
        for key, owner in before.items():
            assert rendezvous_owner(key, after_members) in (owner, changed)


def test_rendezvous_spreads_keys_evenly() -> None:
    members = REPLICAS[:4]
    counts = dict.fromkeys(members, 0)
    for i in range(4000):
        owner = rendezvous_owner(f"session-{i}", members)
        assert owner is not None
        counts[owner] += 1
    assert all(800 < n < 1200 for n in counts.values()), counts
    assert rendezvous_owner("k", []) is None


def view_of(assignment: Assignment, version: int = 1) -> FleetView:
    urls = {r: f"http://127.0.0.1:{9000 + i}" for i, r in enumerate(REPLICAS)}
    entries = {e: EngineEntry(e) for e in ENGINES}
    return FleetView.of(assignment, epoch="e", version=version, urls=urls, engines=entries, incarnations={})


def test_a_minted_session_id_names_its_replica_while_it_lives() -> None:
    assignment = Assignment()
    for replica in REPLICAS[:3]:
        assignment.add_replica(replica)
    for engine in ENGINES[:3]:
        assignment.add_engine(engine)
    session_id = mint_session_id("replica-2", "9f" * 16)
    assert named_replica(session_id) == "replica-2"
    assert named_replica("9f" * 16) is None and named_replica("replica-2.") is None
    view = view_of(assignment)
    assert view.key_owner(session_id) == "replica-2"
    assignment.add_replica("replica-3")  # a replica joins: the session stays where its records are
    assert view_of(assignment).key_owner(session_id) == "replica-2"
    assignment.remove_replica("replica-2")  # its replica is gone: the id hashes like any key
    after = view_of(assignment)
    assert after.key_owner(session_id) == rendezvous_owner(session_id, after.key_candidates)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(REPLICAS), min_size=2, max_size=6, unique=True),
    st.sampled_from(REPLICAS),
    st.text(min_size=1, max_size=16),
)
def test_a_keys_order_is_its_owner_then_whoever_owns_it_as_each_one_before_goes(
    members: list[str], named: str, token: str
) -> None:
    """A session's backup (the second in its order) is the replica that owns it once its owner is gone, so
    the records are where its next turn goes (fleet/replication.py)."""
    assignment = Assignment()
    for replica in members:
        assignment.add_replica(replica)
    for engine in ENGINES:
        assignment.add_engine(engine)
    view = view_of(assignment)
    for key in (token, mint_session_id(named, token)):
        order = view.preference(key)
        assert sorted(order) == sorted(view.key_candidates)
        shrinking = view
        for expected in order:
            assert shrinking.key_owner(key) == expected
            shrinking = shrinking.without(expected)
        assert shrinking.key_owner(key) is None


def test_keys_go_only_to_replicas_that_own_engines() -> None:
    assignment = Assignment()
    for replica in REPLICAS[:3]:
        assignment.add_replica(replica)
    assignment.add_engine(ENGINES[0])
    view = view_of(assignment)
    assert view.key_candidates == ("replica-0",)
    assert {view.key_owner(f"k{i}") for i in range(50)} == {"replica-0"}
    empty = view_of(Assignment())
    assert empty.key_candidates == () and empty.key_owner("k") is None


def test_fleet_engine_ids_are_path_safe_and_stable() -> None:
    ids = {engine_fleet_id(e) for e in ENGINES}
    assert len(ids) == len(ENGINES)
    assert all(i.startswith("e-") and "/" not in i for i in ids)
    assert engine_fleet_id(ENGINES[0]) == engine_fleet_id(ENGINES[0])


SANS_IO = ("assignment.py", "routing.py")
ALLOWED_NON_STDLIB = {"rolloutgate.fleet.assignment"}
FORBIDDEN = {"time", "random", "asyncio", "os", "uuid", "socket", "logging"}


def test_the_rules_are_sans_io() -> None:
    """assignment.py and routing.py import only the standard library (no clock, no randomness, no I/O)
    and each other; the source's AST, so a lazy import counts too."""
    package = Path(assignment_module.__file__).parent
    for name in SANS_IO:
        tree = ast.parse((package / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert top not in FORBIDDEN, f"{name} imports {module}"
                assert (
                    module in ALLOWED_NON_STDLIB or top in sys.stdlib_module_names or top == "__future__"
                ), f"{name} imports {module}"
