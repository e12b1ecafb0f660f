from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.core.wait_queue import SHARED, WaitQueue


def test_fifo_within_priority_and_front_tier_first() -> None:
    q = WaitQueue()
    q.push("late-high", (1, 0, 3))
    q.push("early-low", (1, 5, 1))
    q.push("early-high", (1, 0, 2))
    q.push("requeued", (0, 5, 0))
    order = []
    while (head := q.peek()) is not None:
        order.append(head[1])
        q.remove(head[1])
    assert order == ["requeued", "early-high", "late-high", "early-low"]
    assert len(q) == 0


def test_lanes_move_remove_and_snapshots() -> None:
    q = WaitQueue()
    for i in range(5):
        q.push(f"r{i}", (1, 0, i))
    q.move("r1", ("e1", False))
    q.move("r3", ("e1", False))
    q.move("r2", ("e2", True))
    assert q.lane_of("r1") == ("e1", False)
    assert sorted(q.engine_lanes(), key=str) == [("e1", False), ("e2", True)]
    assert q.ids_in_lane(("e1", False)) == ["r1", "r3"]
    assert q.peek(("e1", False)) == ((1, 0, 1), "r1")
    assert q.remove("r1") and not q.remove("r1")
    assert q.peek(("e1", False)) == ((1, 0, 3), "r3")
    q.remove("r2")
    assert ("e2", True) not in q.engine_lanes()  # an empty lane is dropped
    assert q.ids_in_order() == ["r0", "r3", "r4"]
    assert "r0" in q and "r2" not in q and sorted(q) == ["r0", "r3", "r4"]
    assert q.peek(("nope", True)) is None


def test_push_twice_raises() -> None:
    q = WaitQueue()
    q.push("a", (1, 0, 1))
    with pytest.raises(ValueError):
        q.push("a", (1, 0, 1), ("e", True))


def test_lazy_deletion_compacts() -> None:
    q = WaitQueue()
    q.push("keep", (1, 0, 0))
    for i in range(1, 1000):
        q.push(f"r{i}", (1, 0, i))
        q.remove(f"r{i}")
    assert len(q._heaps[SHARED]) <= 2 * 1 + 32 + 1
    assert q.peek() == ((1, 0, 0), "keep")


@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "remove", "move", "pop"]), st.integers(0, 30), st.integers(0, 2)),
        max_size=200,
    )
)
def test_matches_a_sorted_reference_model(ops: list[tuple[str, int, int]]) -> None:
    q = WaitQueue()
    model: dict[str, tuple[tuple[int, int, int], object]] = {}  # id -> (key, lane)
    lanes = [SHARED, ("e1", False), ("e1", True)]
    for seq, (op, n, lane_no) in enumerate(ops):
        rid, lane = f"r{n}", lanes[lane_no]
        if op == "push" and rid not in model:
            key = (n % 2, n % 3, seq)
            q.push(rid, key, lane)
            model[rid] = (key, lane)
        elif op == "remove":
            assert q.remove(rid) is (rid in model)
            model.pop(rid, None)
        elif op == "move" and rid in model:
            q.move(rid, lane)
            model[rid] = (model[rid][0], lane)
        elif op == "pop":
            head = q.peek(lane)
            expected = min(((k, r) for r, (k, ln) in model.items() if ln == lane), default=None)
            assert head == expected
            if head is not None:
                q.remove(head[1])
                del model[head[1]]
        assert len(q) == len(model)
    assert q.ids_in_order() == [r for _, r in sorted((k, r) for r, (k, _) in model.items())]
