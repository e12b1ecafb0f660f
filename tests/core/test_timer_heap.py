from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.core.timer_heap import TimerHeap


def test_set_replace_discard_and_pop_in_order() -> None:
    t: TimerHeap[str] = TimerHeap()
    t.set("a", 5.0)
    t.set("b", 3.0)
    t.set("a", 1.0)  # replaces 5.0
    t.set("c", 4.0)
    t.discard("c")
    assert t.next_at() == 1.0 and len(t) == 2 and "a" in t and "c" not in t
    assert t.at_of("b") == 3.0 and t.at_of("zzz") == math.inf
    assert t.pop_due(0.5) is None
    assert [t.pop_due(10.0), t.pop_due(10.0), t.pop_due(10.0)] == ["a", "b", None]
    assert t.next_at() == math.inf


def test_inf_means_discard_and_nan_raises() -> None:
    t: TimerHeap[int] = TimerHeap()
    t.set(1, 2.0)
    t.set(1, math.inf)
    assert len(t) == 0
    with pytest.raises(ValueError):
        t.set(2, math.nan)


def test_same_deadline_set_twice_fires_once() -> None:
    t: TimerHeap[str] = TimerHeap()
    t.set("a", 5.0)
    t.set("a", 7.0)
    t.set("a", 5.0)
    assert t.pop_due(10.0) == "a" and t.pop_due(10.0) is None


def test_heap_memory_stays_bounded_under_churn(rng: random.Random) -> None:
    t: TimerHeap[int] = TimerHeap()
    for i in range(20_000):
        t.set(i % 50, rng.random() * 100)
    assert len(t) == 50
    assert len(t._heap) <= 2 * 50 + 64 + 1
    expected = sorted((t.at_of(k), k) for k in range(50))
    assert [t.pop_due(math.inf) for _ in range(50)] == [k for _, k in expected]


@given(
    st.lists(
        st.tuples(st.integers(0, 10), st.one_of(st.floats(0, 100), st.just(math.inf)), st.booleans()),
        max_size=300,
    )
)
def test_matches_a_dict_reference_model(ops: list[tuple[int, float, bool]]) -> None:
    t: TimerHeap[int] = TimerHeap()
    model: dict[int, float] = {}
    for key, at, is_discard in ops:
        if is_discard:
            t.discard(key)
            model.pop(key, None)
        else:
            t.set(key, at)
            if at == math.inf:
                model.pop(key, None)
            else:
                model[key] = at
        assert t.next_at() == min(model.values(), default=math.inf)
        assert len(t) == len(model)
    popped = []
    while (key := t.pop_due(math.inf)) is not None:
        popped.append(key)
    assert sorted(popped) == sorted(model) and [model[k] for k in popped] == sorted(model.values())


def test_deadlines_that_tie_are_due_in_key_order_whatever_order_they_were_set_in() -> None:
    """The driver's deferred deadlines set an engine's timers in another order than eager ones would: the
    order of verdicts at one instant must not depend on it (tests/core/test_gateway_properties.py)."""
    for order in (["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"]):
        heap: TimerHeap[str] = TimerHeap()
        for key in order:
            heap.set(key, 5.0)
        heap.set("a", 9.0)
        heap.set("a", 5.0)  # re-set to the tie: still in key order
        assert [heap.pop_due(5.0) for _ in range(3)] == ["a", "b", "c"]
