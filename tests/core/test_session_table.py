"""Where each session's prefix lives (core/session_table.py), and what a flushed engine cache does to it."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.events import EngineCacheFlushed, EngineJoined
from rolloutgate.core.session_table import SessionTable
from tests.core.helpers import Harness, reference

LONG = 100_000


def test_a_flushed_engine_keeps_its_sessions_but_nothing_of_their_prefixes() -> None:
    table = SessionTable(max_entries=3)
    table.record("a", "e1", 5000, now=0.0)
    table.record("b", "e2", 7000, now=0.0)
    table.record("c", "e1", 9000, now=0.0)
    table.forget_cached("e1")
    assert (table.get("a"), table.get("b"), table.get("c")) == (("e1", 0), ("e2", 7000), ("e1", 0))
    assert table.uncached("a", 6000, "e1") == 6000 and table.uncached("b", 8000, "e2") == 1000
    table.record("d", "e2", 1, now=0.0)  # the LRU order is untouched by the flush: "a" is still the oldest
    assert table.get("a") is None and table.get("c") == ("e1", 0)


def test_after_a_weight_update_a_sessions_next_turn_is_a_cold_prefill_again() -> None:
    """A warm next turn (2K new tokens) is exempt from the prefill budget; after the engine's cache was
    flushed the same turn costs its whole history, so it waits behind a long prompt already in prefill."""
    h = Harness(
        reference(placement="prefill_aware", prefill_budget_exempt_tokens=4096, prefill_rest_ratio=0.0)
    )
    h.send(EngineJoined(engine_id="e1", capacity=16, prefill_token_budget=8192))
    h.arrive("s-t1", routing_key="s", prompt_tokens=LONG)
    h.progress("s-t1")
    h.finish("s-t1")
    h.send(EngineCacheFlushed(engine_id="e1"))
    h.arrive("x0", prompt_tokens=LONG)  # in prefill on e1
    h.arrive("s-t2", routing_key="s", prompt_tokens=LONG + 2000)
    assert [(d.request_id, d.engine_id) for d in h.commands(Dispatch)] == [("s-t1", "e1"), ("x0", "e1")]
    assert h.gw.stats().queue_depth == 1  # s-t2 waits: 102K cold tokens do not fit beside x0
    h.advance(30.0)
    h.progress("x0")
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "s-t2"


def test_a_groups_entry_places_its_siblings_and_a_sessions_own_entry_wins() -> None:
    table = SessionTable(max_entries=4)
    table.record(None, "e1", 20_000, group="g", now=0.0)
    assert table.get(None, "g") == ("e1", 20_000)
    assert table.uncached(None, 20_000, "e1", "g") == 0 and table.uncached(None, 20_000, "e2", "g") == 20_000
    table.record("s", "e2", 3000, now=0.0)
    assert table.get("s", "g") == ("e2", 3000)  # the session's own history decides for its turns
    assert table.get("unknown", "g") == ("e1", 20_000)
    assert len(table) == 1 and table.groups == 1  # groups are not sessions
    assert table.sessions_on("e1") == 0 and table.sessions_on("e2") == 1


def test_sessions_are_counted_per_engine_with_their_history_and_released_at_their_end() -> None:
    table = SessionTable(max_entries=3)
    table.record("a", "e1", 5000, now=0.0)
    table.record("b", "e1", 7000, now=0.0)
    table.record("c", "e2", 9000, now=0.0)
    assert (table.sessions_on("e1"), table.tokens_on("e1"), table.sessions_on("e2")) == (2, 12_000, 1)
    table.grow("a", "e1", 6000, now=0.0)  # a's turn ended: its history there grew
    table.record("b", "e2", 8000, now=0.0)  # b moved
    assert (table.sessions_on("e1"), table.tokens_on("e1")) == (1, 6000)
    assert (table.sessions_on("e2"), table.tokens_on("e2")) == (2, 17_000)
    assert table.release("c") and not table.release("c")
    assert table.is_new_session("c") and not table.is_new_session("b") and not table.is_new_session(None)
    assert (table.sessions_on("e2"), table.tokens_on("e2")) == (1, 8000)
    table.forget_cached("e2")
    assert (table.sessions_on("e2"), table.tokens_on("e2")) == (1, 0)
    table.record("d", "e3", 1, now=0.0)
    table.record("e", "e3", 1, now=0.0)  # over the bound: the least recently used ("a") goes, uncounted
    assert table.get("a") is None and table.sessions_on("e1") == 0 and table.tokens_on("e1") == 0
    assert sum(table.sessions_on(e) for e in ("e1", "e2", "e3")) == len(table) == 3


def test_a_session_idle_past_the_bound_is_released_and_one_in_use_never_is() -> None:
    table = SessionTable(max_entries=10, idle_s=100.0)
    table.record("a", "e1", 5000, now=0.0)
    table.record("b", "e1", 7000, now=10.0)
    table.started("b")  # b's call runs from t=10 for as long as it takes
    table.record("c", "e2", 9000, now=50.0)
    assert table.expire(100.0) == 0  # a idle exactly 100 s: not over the bound
    assert table.expire(100.5) == 1 and table.get("a") is None
    assert (table.sessions_on("e1"), table.tokens_on("e1")) == (1, 7000)
    assert table.expire(500.0) == 1  # c released; b has been in flight for 490 s: kept and counted as used
    assert table.get("c") is None and table.get("b") == ("e1", 7000) and table.in_flight("b") == 1
    table.ended("b", now=550.0)
    assert table.expire(649.0) == 0 and table.expire(650.5) == 1 and len(table) == 0
    assert table.in_flight("b") == 0 and table.sessions_on("e1") == 0
    with pytest.raises(ValueError, match="idle_s"):
        SessionTable(max_entries=1, idle_s=0.0)


def test_calls_of_a_released_session_are_still_counted_until_they_end() -> None:
    table = SessionTable(max_entries=10, idle_s=100.0)
    table.record("s", "e1", 10, now=0.0)
    table.started("s")
    table.started("s")
    assert table.release("s") and table.in_flight("s") == 2
    table.ended("s", now=2.0)  # not bound any more: nothing to touch, the count still drops
    table.ended("s", now=3.0)
    assert table.in_flight("s") == 0 and table.get("s") is None and table.expire(1e9) == 0
