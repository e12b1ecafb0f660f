"""Per-engine slots: capacity, the prefill budget, exempt prefills and the rest after a storm of prefills."""

from __future__ import annotations

import math

import pytest

from rolloutgate.core.admission import EngineSlots, default_prefill_budget
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
    s.in_flight, s.prefill_tokens, s.budget_tokens = in_flight, in_prefill, in_prefill
    assert s.can_admit(uncached) is admit


def test_counts_through_admit_prefill_and_release() -> None:
    s = EngineSlots(capacity=3, prefill_token_budget=10_000)
    s.admit(500, 0.0)
    s.admit(7000, 0.0)
    assert (s.in_flight, s.prefilling, s.decoding, s.prefill_tokens, s.budget_tokens) == (2, 2, 0, 7500, 7500)
    assert s.finish_prefill(500, 1.0) == math.inf  # no rest configured
    assert (s.prefilling, s.decoding, s.prefill_tokens, s.budget_tokens) == (1, 1, 7000, 7000)
    s.release(7000, is_in_prefill=True)  # aborted in prefill: its tokens come back
    s.release(500, is_in_prefill=False)  # finished after decoding
    assert (s.in_flight, s.prefilling, s.prefill_tokens, s.budget_tokens, s.has_room()) == (0, 0, 0, 0, True)
    with pytest.raises(ValueError):
        s.release(0, is_in_prefill=False)


def test_small_prefills_are_exempt_from_the_budget() -> None:
    s = EngineSlots(capacity=4, prefill_token_budget=8000, exempt_below_tokens=4096)
    s.admit(100_000, 0.0)  # a long prompt alone: the budget is full
    assert not s.can_admit(4096) and not s.can_admit(50_000)
    assert s.can_admit(4095)  # a session's next turn: needs only a slot
    s.admit(2000, 0.0)
    assert (s.prefill_tokens, s.budget_tokens) == (102_000, 100_000)  # counted for placement, not the budget
    s.finish_prefill(100_000, 30.0)
    assert s.can_admit(50_000)  # the budget is free again: a long prompt may start (alone)
    s.admit(6000, 30.0)
    assert s.can_admit(2000) and not s.can_admit(4096)  # 6,000 + 4,096 > 8,000
    s.admit(3000, 30.0)
    assert s.in_flight == 4 and not s.can_admit(0)  # exempt still needs a slot
    with pytest.raises(ValueError):
        EngineSlots(capacity=1, exempt_below_tokens=-1)


def test_rest_after_the_last_budgeted_prefill_is_proportional_to_the_burst() -> None:
    s = EngineSlots(capacity=8, prefill_token_budget=20_000, exempt_below_tokens=1000, rest_ratio=0.5)
    s.admit(9000, 100.0)  # the burst starts at 100
    s.admit(8000, 104.0)
    s.admit(500, 105.0)  # exempt: no part of the burst
    assert s.finish_prefill(500, 106.0) == math.inf  # an exempt prefill never starts a rest
    assert s.finish_prefill(9000, 120.0) == math.inf  # another budgeted prefill is still in progress
    assert s.finish_prefill(8000, 140.0) == pytest.approx(140.0 + 0.5 * 40.0)  # 40 s busy -> 20 s rest
    assert s.is_resting and s.rest_tokens == 8500  # 0.5 x 17,000 tokens, shown to placement as backlog
    assert not s.can_admit(5000) and s.can_admit(999)  # budgeted prefills wait; exempt ones go
    s.end_rest()
    assert not s.is_resting and s.rest_tokens == 0 and s.can_admit(20_000)


def test_no_rest_without_a_ratio_or_after_an_abort() -> None:
    s = EngineSlots(capacity=8, prefill_token_budget=20_000, rest_ratio=1.0)
    s.admit(9000, 0.0)
    s.release(9000, is_in_prefill=True)  # aborted in prefill: no rest, the budget is simply free
    assert not s.is_resting and s.can_admit(20_000)
    s.admit(0, 5.0)  # nothing uncached (a fully cached prompt, no exemption): counts, but costs no rest
    assert s.finish_prefill(0, 6.0) == math.inf
    with pytest.raises(ValueError):
        EngineSlots(capacity=1, rest_ratio=-0.1)
    with pytest.raises(ValueError):
        EngineSlots(capacity=1, rest_ratio=math.inf)


def test_session_table_estimates_uncached_and_is_lru() -> None:
    t = SessionTable(max_entries=2)
    t.record("s1", "e1", 1000, now=0.0)
    t.record(None, "e1", 5, now=0.0)  # no key: nothing recorded
    assert t.uncached("s1", 1200, "e1") == 200
    assert t.uncached("s1", 1200, "e2") == 1200
    assert t.uncached("s1", 800, "e1") == 0
    assert t.uncached(None, 50, "e1") == 50
    t.record("s2", "e1", 1, now=0.0)
    t.get("s1")
    t.record("s3", "e2", 1, now=0.0)  # evicts the least recently *recorded* (s1)
    assert t.get("s1") is None and t.get("s3") == ("e2", 1) and len(t) == 2
    t.grow("s3", "e1", 999, now=0.0)  # finished on an engine the session has left: ignored
    t.grow("s3", "e2", 50, now=0.0)
    t.grow("new", "e1", 7, now=0.0)
    assert t.get("s3") == ("e2", 50) and t.get("new") == ("e1", 7)
    with pytest.raises(ValueError):
        SessionTable(0)


@pytest.mark.parametrize(
    ("chunk", "capacity", "budget"),
    [
        (8192, 256, 32_768),  # SGLang on an H100/H200: 4 chunks
        (8192, 4096, 65_536),  # SGLang's own default capacity: at most 8 chunks
        (8192, 8, 8192),  # a small engine: one chunk
        (512, 256, 2048),  # the simulator's incident profile: every long prompt runs alone
        (None, 64, 8192),  # not reported (vLLM, OpenAI-compatible): the common 8,192
    ],
)
def test_default_budget_from_chunk_size_and_capacity(chunk: int | None, capacity: int, budget: int) -> None:
    assert default_prefill_budget(chunk, capacity) == budget


def test_default_budget_rejects_nonsense_and_no_budget_means_no_rest() -> None:
    with pytest.raises(ValueError):
        default_prefill_budget(0, 8)
    with pytest.raises(ValueError):
        default_prefill_budget(512, 0)
    s = EngineSlots(capacity=4, rest_ratio=1.0)  # no budget: admission is off, and so is the rest
    s.admit(100_000, 0.0)
    assert s.finish_prefill(100_000, 30.0) == math.inf and not s.is_resting
