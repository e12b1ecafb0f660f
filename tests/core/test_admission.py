from __future__ import annotations

import math

import pytest

from rolloutgate.core.admission import EngineSlots
from rolloutgate.core.session_table import SessionTable


@pytest.mark.parametrize(
    ("capacity", "budget", "in_prefill", "in_flight", "uncached", "admit"),
    [
        (2, math.inf, 0, 0, 100_000, True),
        (2, math.inf, 0, 2, 1, False),  # no slot
        (4, 8000, 5000, 1, 3000, True),  # fits the budget
        (4, 8000, 5000, 1, 3001, False),  # does not fit
        (4, 8000, 0, 2, 100_000, True),  # larger than the budget, but alone in prefill: runs
        (4, 8000, 100_000, 1, 0, False),  # a huge prefill alone fills the budget
    ],
)
def test_can_admit(
    capacity: int, budget: float, in_prefill: int, in_flight: int, uncached: int, admit: bool
) -> None:
    s = EngineSlots(capacity=capacity, prefill_token_budget=budget)
    s.in_flight, s.prefill_tokens = in_flight, in_prefill
    assert s.can_admit(uncached) is admit


def test_admit_prefill_release_cycle() -> None:
    s = EngineSlots(capacity=1)
    s.admit(500)
    assert (s.in_flight, s.prefill_tokens, s.has_room()) == (1, 500, False)
    s.finish_prefill(500)
    s.release(0)
    assert (s.in_flight, s.prefill_tokens, s.has_room()) == (0, 0, True)
    with pytest.raises(ValueError):
        s.release(0)


def test_session_table_estimates_uncached_and_is_lru() -> None:
    t = SessionTable(max_entries=2)
    t.record("s1", "e1", 1000)
    t.record(None, "e1", 5)  # no key: nothing recorded
    assert t.uncached("s1", 1200, "e1") == 200
    assert t.uncached("s1", 1200, "e2") == 1200
    assert t.uncached("s1", 800, "e1") == 0
    assert t.uncached(None, 50, "e1") == 50
    t.record("s2", "e1", 1)
    t.get("s1")
    t.record("s3", "e2", 1)  # evicts the least recently *recorded* (s1)
    assert t.get("s1") is None and t.get("s3") == ("e2", 1) and len(t) == 2
    t.grow("s3", "e1", 999)  # finished on an engine the session has left: ignored
    t.grow("s3", "e2", 50)
    t.grow("new", "e1", 7)
    assert t.get("s3") == ("e2", 50) and t.get("new") == ("e1", 7)
    with pytest.raises(ValueError):
        SessionTable(0)
