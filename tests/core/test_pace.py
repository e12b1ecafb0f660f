"""The pace's rules on their own (core/pace.py): the budget, arrival order, and off."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rolloutgate.core.pace import StalenessPace


def test_off_admits_everything_and_counts_nothing() -> None:
    pace = StalenessPace(None, None)
    assert all(pace.admit(str(i), opens_work=True, version=0) for i in range(100))
    assert (pace.admitted, pace.held, pace.release(5)) == (0, 0, [])


def test_a_later_arrival_never_overtakes_a_held_one() -> None:
    pace = StalenessPace(1, 0)
    assert pace.admit("a", opens_work=True, version=0)
    assert not pace.admit("b", opens_work=True, version=0)
    # version 1 has room for one more, but b waits first: c must not take its place
    assert not pace.admit("c", opens_work=True, version=1)
    assert pace.release(1) == ["b"]
    assert pace.release(2) == ["c"]


@given(
    batch=st.integers(1, 5),
    bound=st.integers(0, 3),
    steps=st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=40),
)
def test_admitted_never_exceeds_the_budget_and_held_calls_go_in_order(
    batch: int, bound: int, steps: list[tuple[int, bool]]
) -> None:
    """Rule 1 and 2 over random runs: arrivals (a count per step), then maybe an update."""
    pace = StalenessPace(batch, bound)
    version, order, admitted_order = 0, 0, []
    for arrivals, update in steps:
        for _ in range(arrivals):
            order += 1
            if pace.admit(str(order), opens_work=True, version=version):
                admitted_order.append(order)
        if update:
            version += 1
            admitted_order += [int(rid) for rid in pace.release(version)]
        assert pace.admitted <= batch * (version + bound + 1)
        assert pace.admitted == len(admitted_order)
    assert admitted_order == sorted(admitted_order)
