"""Consistent hashing (core/placement/consistent_hash.py): a key's engine by rendezvous score, whatever its load."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.placement import ConsistentHash, PlacementRequest, make_policy
from rolloutgate.core.placement.consistent_hash import rendezvous_score
from tests.core.helpers import Harness, reference


@dataclass
class View:
    engine_id: str
    order: int
    in_flight: int = 0
    outstanding_tokens: int = 0
    capacity: int = 4

    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    def can_admit(self, request: PlacementRequest) -> bool:
        return self.has_room()


def call(key: str | None, **kw: object) -> PlacementRequest:
    return PlacementRequest(request_id="r", prompt_tokens=100, routing_key=key, **kw)  # type: ignore[arg-type]


def test_a_key_goes_where_it_scores_highest_full_or_not_and_an_engine_that_leaves_moves_only_its_keys() -> (
    None
):
    views = [View(engine_id=f"e{i}", order=i) for i in range(4)]
    policy = ConsistentHash()
    keys = [f"session-{i}" for i in range(400)]
    placed = {k: policy.choose(call(k), views) for k in keys}
    assert all(
        placed[k] == max(views, key=lambda e: rendezvous_score(k, e.engine_id)).engine_id for k in keys
    )
    assert min(Counter(placed.values()).values()) > 60  # about a quarter each
    full = next(v for v in views if v.engine_id == placed["session-0"])
    full.in_flight = full.capacity
    assert policy.choose(call("session-0"), views) == full.engine_id  # it waits for its engine
    without_e3 = [v for v in views if v.engine_id != "e3"]
    moved = [k for k in keys if policy.choose(call(k), without_e3) != placed[k]]
    assert moved and all(placed[k] == "e3" for k in moved)
    least = min((v for v in views if v.has_room()), key=lambda v: v.order)  # all idle but the full one
    assert policy.choose(call(None), views) == least.engine_id  # keyless: least loaded
    assert (
        policy.choose(call("session-0", avoid_engines=frozenset({full.engine_id})), views) != full.engine_id
    )
    pinned = next(v for v in views if v is not full)
    assert policy.choose(call("session-0", pinned_engine=pinned.engine_id), views) == pinned.engine_id
    assert policy.choose(call("session-1", pinned_engine=full.engine_id), views) is None  # full: it waits
    assert isinstance(make_policy("consistent_hash"), ConsistentHash)


def test_in_the_core_a_full_engine_keeps_its_keys_waiting_while_another_has_room() -> None:
    h = Harness(reference(placement="consistent_hash"))
    h.engines(e0=1, e1=1)
    keys = [k for k in (f"k{i}" for i in range(50)) if rendezvous_score(k, "e0") > rendezvous_score(k, "e1")]
    h.arrive("a", routing_key=keys[0], prompt_tokens=100)
    h.arrive("b", routing_key=keys[1], prompt_tokens=100)  # e0 is full: b waits for it, e1 stays idle
    h.arrive("c", prompt_tokens=100)  # keyless: the free engine
    assert [(d.request_id, d.engine_id) for d in h.commands(Dispatch)] == [("a", "e0"), ("c", "e1")]
    h.progress("a")
    h.finish("a")
    assert [(d.request_id, d.engine_id) for d in h.commands(Dispatch)][-1] == ("b", "e0")
