"""The session registry: lifecycle, idle TTL, limits, the memory bound, turn planning, commits and copies."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import pytest

from rolloutgate.core.clock import ManualClock
from rolloutgate.sessions.errors import (
    SessionConflict,
    SessionDiverged,
    SessionEvicted,
    SessionNotFound,
    SessionRecordLimit,
    SessionsFull,
    TruncatedGeneration,
)
from rolloutgate.sessions.messages import message_key, tools_key
from rolloutgate.sessions.record import ids_array
from rolloutgate.sessions.registry import SessionLimits, SessionRegistry
from rolloutgate.sessions.session import TurnBase, TurnKind


def registry(**limits: Any) -> SessionRegistry:
    counter = itertools.count()
    return SessionRegistry(SessionLimits(**limits), id_factory=lambda: f"s{next(counter)}")


def commit(reg: SessionRegistry, clock: ManualClock, session_id: str, record: Any) -> None:
    session = reg.get(session_id, clock.now())
    base = TurnBase(kind=TurnKind.EXTEND, keep_turns=session.turns, messages_from=record.messages_from)
    ticket = reg.begin_turn(session, base, record.request_key, clock.now())
    reg.commit_turn(ticket, record, clock.now())


def test_create_get_delete(clock: ManualClock) -> None:
    reg = registry()
    session = reg.create(clock.now())
    assert reg.get(session.session_id, clock.now()) is session
    reg.delete(session.session_id, clock.now())
    with pytest.raises(SessionNotFound) as info:
        reg.get(session.session_id, clock.now())
    assert info.value.status == 404 and info.value.code == "session_not_found"
    with pytest.raises(SessionNotFound):
        reg.delete("nope", clock.now())
    stats = reg.stats()
    assert (stats.created_total, stats.deleted_total, stats.sessions) == (1, 1, 0)


def test_idle_ttl_evicts_and_then_gone(clock: ManualClock) -> None:
    reg = registry(idle_ttl_s=60)
    old, young = reg.create(clock.now()), None
    clock.advance(30)
    young = reg.create(clock.now())
    assert reg.next_expiry_at() == pytest.approx(clock.now() + 30)
    clock.advance(29.9)
    assert reg.expire(clock.now()) == []
    clock.advance(0.1)
    assert reg.expire(clock.now()) == [old.session_id]
    with pytest.raises(SessionEvicted) as info:
        reg.get(old.session_id, clock.now())
    assert info.value.status == 410 and "idle ttl" in info.value.message
    assert reg.get(young.session_id, clock.now()) is young  # touched: its TTL restarts
    clock.advance(59)
    assert reg.expire(clock.now()) == []
    assert reg.stats().evicted_idle_ttl_total == 1


def test_get_evicts_lazily_without_a_sweep(clock: ManualClock) -> None:
    reg = registry(idle_ttl_s=10)
    session = reg.create(clock.now())
    clock.advance(10)
    with pytest.raises(SessionEvicted):
        reg.get(session.session_id, clock.now())


def test_a_turn_in_flight_keeps_the_session_past_its_ttl(clock: ManualClock, record: Any) -> None:
    reg = registry(idle_ttl_s=10)
    session = reg.create(clock.now())
    ticket = reg.begin_turn(
        session, TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0), b"k", clock.now()
    )
    clock.advance(100)
    assert reg.expire(clock.now()) == []
    assert reg.next_expiry_at() == math.inf
    reg.commit_turn(ticket, record(0, prompt_new_ids=[1, 2]), clock.now())
    clock.advance(9.99)
    assert reg.expire(clock.now()) == []
    clock.advance(0.01)
    assert reg.expire(clock.now()) == [session.session_id]


def test_tombstones_are_bounded(clock: ManualClock) -> None:
    reg = registry(idle_ttl_s=1, max_tombstones=2)
    ids = [reg.create(clock.now()).session_id for _ in range(3)]
    clock.advance(1)
    assert reg.expire(clock.now()) == ids
    with pytest.raises(SessionNotFound):  # the oldest tombstone was dropped
        reg.get(ids[0], clock.now())
    for session_id in ids[1:]:
        with pytest.raises(SessionEvicted):
            reg.get(session_id, clock.now())


def test_max_sessions_evicts_the_least_recently_used_idle_session(clock: ManualClock) -> None:
    reg = registry(max_sessions=2)
    a = reg.create(clock.now())
    clock.advance(1)
    b = reg.create(clock.now())
    clock.advance(1)
    reg.get(a.session_id, clock.now())  # a is now more recent than b
    c = reg.create(clock.now())
    with pytest.raises(SessionEvicted) as info:
        reg.get(b.session_id, clock.now())
    assert "capacity" in info.value.message
    assert {reg.get(a.session_id, clock.now()), reg.get(c.session_id, clock.now())} == {a, c}
    assert reg.stats().evicted_capacity_total == 1


def test_full_of_busy_sessions_answers_429(clock: ManualClock) -> None:
    reg = registry(max_sessions=1)
    session = reg.create(clock.now())
    reg.begin_turn(session, TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0), b"k", clock.now())
    with pytest.raises(SessionsFull) as info:
        reg.create(clock.now())
    assert info.value.status == 429 and info.value.code == "session_limit"
    assert reg.stats().rejected_full_total == 1


def test_without_eviction_a_full_registry_answers_429(clock: ManualClock) -> None:
    reg = registry(max_sessions=1, evict_when_full=False)
    reg.create(clock.now())
    with pytest.raises(SessionsFull):
        reg.create(clock.now())


def test_max_records_per_session(clock: ManualClock, record: Any) -> None:
    reg = registry(max_records_per_session=2)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, record(0, prompt_new_ids=[1]))
    commit(reg, clock, session.session_id, record(1, prompt_prefix_len=3, prompt_new_ids=[5]))
    with pytest.raises(SessionRecordLimit) as info:
        commit(reg, clock, session.session_id, record(2))
    assert info.value.status == 400 and info.value.code == "session_record_limit"
    # a retry of the last turn replaces it, so it stays within the limit
    base = TurnBase(kind=TurnKind.RETRY, keep_turns=1, messages_from=2)
    reg.begin_turn(session, base, b"retry", clock.now())


def test_memory_bound_evicts_idle_sessions_first(clock: ManualClock, record: Any) -> None:
    big = record(0, payload="x" * 5000)
    reg = registry(max_bytes=3 * big.approx_bytes)
    a, b = reg.create(clock.now()), reg.create(clock.now())
    commit(reg, clock, a.session_id, record(0, payload="x" * 5000))
    clock.advance(1)
    commit(reg, clock, b.session_id, record(0, payload="x" * 5000))
    assert reg.stats().approx_bytes <= reg.limits.max_bytes
    clock.advance(1)
    commit(reg, clock, b.session_id, record(1, prompt_prefix_len=4, payload="x" * 5000))
    with pytest.raises(SessionEvicted) as info:  # a was the least recently used
        reg.get(a.session_id, clock.now())
    assert "memory" in info.value.message
    stats = reg.stats()
    assert stats.evicted_memory_total == 1
    assert stats.approx_bytes <= reg.limits.max_bytes
    assert stats.approx_bytes == reg.get(b.session_id, clock.now()).approx_bytes


def test_memory_bound_never_evicts_the_committing_or_busy_sessions(clock: ManualClock, record: Any) -> None:
    big = record(0, payload="x" * 5000)
    reg = registry(max_bytes=big.approx_bytes)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, big)  # over the bound, but nothing else to evict
    assert reg.get(session.session_id, clock.now()).turns == 1
    reg.begin_turn(session, TurnBase(kind=TurnKind.EXTEND, keep_turns=1, messages_from=2), b"x", clock.now())
    with pytest.raises(SessionsFull):  # busy sessions are never evicted: no room for another
        reg.create(clock.now())
    assert reg.stats().evicted_memory_total == 0


def test_a_second_request_in_flight_is_a_conflict_unless_it_is_a_retry(clock: ManualClock) -> None:
    reg = registry()
    session = reg.create(clock.now())
    base = TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0)
    reg.begin_turn(session, base, b"same", clock.now())
    reg.begin_turn(session, base, b"same", clock.now())  # a client retry may run (or attach) meanwhile
    with pytest.raises(SessionConflict) as info:
        reg.begin_turn(session, base, b"other", clock.now())
    assert info.value.status == 409 and info.value.code == "session_busy"
    assert reg.stats().turns_in_flight == 2


def test_twin_commits_record_once(clock: ManualClock, record: Any) -> None:
    reg = registry()
    session = reg.create(clock.now())
    base = TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0)
    first = reg.begin_turn(session, base, b"key-0", clock.now())
    second = reg.begin_turn(session, base, b"key-0", clock.now())
    kept = reg.commit_turn(first, record(0), clock.now())
    assert reg.commit_turn(second, record(0), clock.now()) is kept
    assert session.turns == 1 and reg.stats().duplicate_commits_total == 1
    assert not session.in_flight


def test_end_turn_is_a_no_op_after_commit_and_counts_abandons(clock: ManualClock, record: Any) -> None:
    reg = registry()
    session = reg.create(clock.now())
    base = TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0)
    ticket = reg.begin_turn(session, base, b"key-0", clock.now())
    reg.commit_turn(ticket, record(0), clock.now())
    reg.end_turn(ticket, clock.now())
    abandoned = reg.begin_turn(
        session, TurnBase(kind=TurnKind.EXTEND, keep_turns=1, messages_from=2), b"x", clock.now()
    )
    reg.end_turn(abandoned, clock.now())
    stats = reg.stats()
    assert (stats.turns_committed_total, stats.turns_abandoned_total, stats.turns_in_flight) == (1, 1, 0)


def test_commit_after_delete_raises_not_found(clock: ManualClock, record: Any) -> None:
    reg = registry()
    session = reg.create(clock.now())
    ticket = reg.begin_turn(
        session, TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0), b"key-0", clock.now()
    )
    reg.delete(session.session_id, clock.now())
    with pytest.raises(SessionNotFound):
        reg.commit_turn(ticket, record(0), clock.now())


def _keys(messages: list[dict[str, Any]]) -> list[bytes]:
    return [message_key(m) for m in messages]


def test_plan_turn_rules(clock: ManualClock, record: Any) -> None:
    reg = registry()
    session = reg.create(clock.now())
    sid = session.session_id
    no_tools = tools_key(None, None)
    user0 = [{"role": "user", "content": "turn 0"}]
    assert reg.plan_turn(session, user0, _keys(user0), no_tools, strict=True).kind is TurnKind.FIRST
    commit(reg, clock, sid, record(0, new_messages=user0, reply="a0"))
    state1 = [*user0, {"role": "assistant", "content": "a0"}]
    turn1 = [*state1, {"role": "user", "content": "turn 1"}]
    plan = reg.plan_turn(session, turn1, _keys(turn1), no_tools, strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.EXTEND, 1, 2)
    commit(
        reg, clock, sid, record(1, prompt_prefix_len=4, messages_from=2, new_messages=turn1[2:], reply="a1")
    )

    # the same request again: a retry of the last turn, which will replace it
    plan = reg.plan_turn(session, turn1, _keys(turn1), no_tools, strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.RETRY, 1, 2)
    # re-running from the turn before with a different message: roll back one turn
    other = [*state1, {"role": "user", "content": "something else"}]
    plan = reg.plan_turn(session, other, _keys(other), no_tools, strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.ROLLBACK, 1, 2)
    # changing earlier history diverges (strict) or restarts the chain (recorded mode)
    edited = [{"role": "user", "content": "edited"}, *turn1[1:]]
    with pytest.raises(SessionDiverged) as info:
        reg.plan_turn(session, edited, _keys(edited), no_tools, strict=True)
    assert info.value.status == 400 and info.value.code == "session_diverged"
    assert info.value.message == (  # two turns back: miles' words
        "rollback failed: discard_count=2 exceeds max_assistant_rollback_steps=1 "
        "(stored has 4 messages, request has 3 messages)"
    )
    plan = reg.plan_turn(session, edited, _keys(edited), no_tools, strict=False)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.RESTART, 2, 0)
    # same messages, other tools: diverged, and said so
    extended = [*turn1, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "turn 2"}]
    with pytest.raises(SessionDiverged, match="tools"):
        reg.plan_turn(
            session, extended, _keys(extended), tools_key([{"type": "function"}], None), strict=True
        )
    assert reg.stats().diverged_total == 2


def test_rollback_takes_effect_at_commit(clock: ManualClock, record: Any) -> None:
    reg = registry()
    session = reg.create(clock.now())
    sid = session.session_id
    commit(reg, clock, sid, record(0, prompt_new_ids=[1, 2], output_ids=[3, 4]))
    commit(
        reg, clock, sid, record(1, prompt_prefix_len=4, prompt_new_ids=[5], output_ids=[6], messages_from=2)
    )
    assert session.token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    bytes_before = reg.stats().approx_bytes
    base = TurnBase(kind=TurnKind.RETRY, keep_turns=1, messages_from=2)
    ticket = reg.begin_turn(session, base, b"key-1", clock.now())
    assert session.turns == 2  # not yet
    reg.commit_turn(
        ticket,
        record(1, prompt_prefix_len=4, prompt_new_ids=[5], output_ids=[7, 8], messages_from=2),
        clock.now(),
    )
    assert session.turns == 2
    assert session.token_ids.tolist() == [1, 2, 3, 4, 5, 7, 8]
    assert [r.output_ids.tolist() for r in session.records] == [[3, 4], [7, 8]]
    stats = reg.stats()
    assert stats.turns_rolled_back_total == 1
    # one more output id: 4 bytes in the record, 4 in the accumulated ids, 8 for its logprob
    assert stats.approx_bytes - bytes_before == 4 + 4 + 8


def test_stats_and_metric_samples(clock: ManualClock, record: Any) -> None:
    reg = registry(max_sessions=7, idle_ttl_s=math.inf)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, record(0))
    stats = reg.stats()
    assert (stats.sessions, stats.records, stats.max_sessions, stats.idle_ttl_s) == (1, 1, 7, math.inf)
    samples = {
        (name, tuple(sorted(labels.items()))): value for name, _, _, labels, value in stats.metric_samples()
    }
    assert samples[("rolloutgate_sessions", ())] == 1
    assert samples[("rolloutgate_sessions_max", ())] == 7
    assert samples[("rolloutgate_sessions_bytes", ())] == stats.approx_bytes
    assert samples[("rolloutgate_session_turns_total", (("outcome", "committed"),))] == 1
    assert samples[("rolloutgate_sessions_evicted_total", (("reason", "idle_ttl"),))] == 0
    assert "1 turns" in repr(session) and "1 sessions" in repr(reg)


@pytest.mark.parametrize(
    "bad", [{"idle_ttl_s": 0}, {"idle_ttl_s": math.nan}, {"max_sessions": 0}, {"max_bytes": 0}]
)
def test_limits_validate(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SessionLimits(**bad)


# -- copies (a fleet's backup replica) --------------------------------------------------------------------------


class ListJournal:
    """Every journal call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int | None]] = []

    def session_created(self, session_id: str) -> None:
        self.calls.append(("created", session_id, None))

    def turn_committed(self, session_id: str, record: Any) -> None:
        self.calls.append(("turn", session_id, record.index))

    def session_removed(self, session_id: str) -> None:
        self.calls.append(("removed", session_id, None))


def two_turns(clock: ManualClock, record: Any) -> tuple[SessionRegistry, str]:
    owner = registry()
    sid = owner.create(clock.now()).session_id
    commit(owner, clock, sid, record(0, prompt_new_ids=[1, 2], output_ids=[3, 4]))
    commit(
        owner, clock, sid, record(1, prompt_prefix_len=4, prompt_new_ids=[5], output_ids=[6], messages_from=2)
    )
    return owner, sid


def test_a_copy_rebuilds_the_session_and_is_journaled(clock: ManualClock, record: Any) -> None:
    owner, sid = two_turns(clock, record)
    journal = ListJournal()
    backup = SessionRegistry(SessionLimits(), journal=journal)
    copy = owner.copy_of(sid)
    assert copy is not None and backup.take_copy(copy, clock.now(), newer_only=False)
    held = backup.get(sid, clock.now())
    assert held.token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert held.state_after(2) == owner.get(sid, clock.now()).state_after(2)
    assert journal.calls == [
        ("removed", sid, None),
        ("created", sid, None),
        ("turn", sid, 0),
        ("turn", sid, 1),
    ]
    assert owner.copy_of("nobody") is None


def test_a_copy_takes_the_owners_next_turn_only_on_top_of_the_owners_turn_before(
    clock: ManualClock, record: Any
) -> None:
    owner, sid = two_turns(clock, record)
    backup = registry()
    first = owner.copy_of(sid)
    assert first is not None
    backup.take_copy(first, clock.now(), newer_only=False)
    third = record(2, prompt_prefix_len=6, prompt_new_ids=[7], output_ids=[8], messages_from=4)
    assert not backup.take_turn(sid, third, "not-the-owners", clock.now())  # its turn 1 is another one
    assert backup.take_turn(sid, third, "r1", clock.now())
    assert backup.take_turn(sid, third, "r1", clock.now())  # sent twice: held already, nothing changes
    assert backup.get(sid, clock.now()).token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    fifth = record(4, prompt_prefix_len=8, prompt_new_ids=[9], output_ids=[10], messages_from=6)
    assert not backup.take_turn(sid, fifth, "r3", clock.now())  # it lacks turn 3: the owner sends it whole
    assert not backup.take_turn("unknown", third, "r1", clock.now())
    # the owner retried turn 2 (a new request id): the copy replaces its turn 2 as the owner did
    retried = dataclasses.replace(third, request_id="r2-again", output_ids=ids_array([11]))
    assert backup.take_turn(sid, retried, "r1", clock.now())
    assert backup.get(sid, clock.now()).token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 11]


def test_a_pulled_copy_never_replaces_a_longer_one_and_a_busy_session_takes_none(
    clock: ManualClock, record: Any
) -> None:
    owner, sid = two_turns(clock, record)
    longer = owner.copy_of(sid)
    assert longer is not None
    shorter = dataclasses.replace(longer, records=longer.records[:1])
    held = registry()
    held.take_copy(longer, clock.now(), newer_only=False)
    assert not held.take_copy(shorter, clock.now(), newer_only=True)
    assert held.get(sid, clock.now()).turns == 2
    assert held.take_copy(shorter, clock.now(), newer_only=False)  # the owner's own word wins
    assert held.get(sid, clock.now()).turns == 1
    session = held.get(sid, clock.now())
    held.begin_turn(session, TurnBase(kind=TurnKind.EXTEND, keep_turns=1, messages_from=2), b"k", clock.now())
    assert not held.take_copy(longer, clock.now(), newer_only=False)  # served here right now
    assert not held.take_turn(sid, longer.records[1], "r0", clock.now())


def test_a_dropped_copy_is_gone_without_a_tombstone(clock: ManualClock, record: Any) -> None:
    owner, sid = two_turns(clock, record)
    held = registry()
    copy = owner.copy_of(sid)
    assert copy is not None
    held.take_copy(copy, clock.now(), newer_only=False)
    held.drop_copy(sid)
    held.drop_copy(sid)  # twice: nothing more
    with pytest.raises(SessionNotFound):
        held.get(sid, clock.now())
    assert held.stats().approx_bytes == 0


def test_tree_sessions_branch_from_the_root_and_from_deep_turns_as_miles_v2_does(
    clock: ManualClock, record: Any
) -> None:
    """miles' v2 opens a new root for a first message that differs and branches at any depth; a linear session
    refuses both (test_plan_turn_rules)."""
    reg = registry(keep_branches=True)
    session = reg.create(clock.now())
    sid = session.session_id
    no_tools = tools_key(None, None)
    history: list[dict[str, Any]] = []
    for turn in range(3):
        new = [{"role": "user", "content": f"turn {turn}"}]
        commit(reg, clock, sid, record(turn, messages_from=len(history), new_messages=new, reply=f"a{turn}"))
        history = [*history, *new, {"role": "assistant", "content": f"a{turn}"}]
    deep = [*history[:2], {"role": "user", "content": "another turn 1"}]  # shares only turn 0's state
    plan = reg.plan_turn(session, deep, _keys(deep), no_tools, strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.ROLLBACK, 1, 2)
    root = [{"role": "user", "content": "a new task"}]
    plan = reg.plan_turn(session, root, _keys(root), no_tools, strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.ROLLBACK, 0, 0)
    with pytest.raises(SessionDiverged):  # the same requests, on a linear session
        registry().plan_turn(_three_turns(clock, record), root, _keys(root), no_tools, strict=True)


def _three_turns(clock: ManualClock, record: Any) -> Any:
    reg = registry()
    session = reg.create(clock.now())
    history = 0
    for turn in range(3):
        commit(reg, clock, session.session_id, record(turn, messages_from=history))
        history += 2
    return session


def test_a_tree_session_refuses_to_extend_a_turn_cut_off_at_length_but_retries_it(
    clock: ManualClock, record: Any
) -> None:
    reg = registry(keep_branches=True)
    session = reg.create(clock.now())
    user0 = [{"role": "user", "content": "turn 0"}]
    cut = dataclasses.replace(record(0, new_messages=user0, reply="a0"), finish_reason="length")
    commit(reg, clock, session.session_id, cut)
    no_tools = tools_key(None, None)
    onward = [*user0, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "go on"}]
    with pytest.raises(TruncatedGeneration) as info:
        reg.plan_turn(session, onward, _keys(onward), no_tools, strict=True)
    assert info.value.status == 409 and info.value.code == "truncated_generation"
    assert reg.plan_turn(session, user0, _keys(user0), no_tools, strict=True).kind is TurnKind.RETRY
    linear = registry()  # a linear session extends it, as miles' v1 does
    plain = linear.create(clock.now())
    commit(linear, clock, plain.session_id, cut)
    assert linear.plan_turn(plain, onward, _keys(onward), no_tools, strict=True).kind is TurnKind.EXTEND


def test_a_tree_session_of_one_turn_opens_a_new_root(clock: ManualClock, record: Any) -> None:
    reg = registry(keep_branches=True)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, record(0))
    other = [{"role": "user", "content": "another task"}]
    plan = reg.plan_turn(session, other, _keys(other), tools_key(None, None), strict=True)
    assert (plan.kind, plan.keep_turns, plan.messages_from) == (TurnKind.ROLLBACK, 0, 0)


def test_concurrent_turns_of_a_tree_session_commit_as_siblings(clock: ManualClock, record: Any) -> None:
    """miles' v2: two turns from one parent running at once both commit, under that parent; a linear session
    takes one at a time (a different request in flight: 409) and keeps one record of a retry's twins."""
    reg = registry(keep_branches=True)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, record(0))
    base = TurnBase(kind=TurnKind.EXTEND, keep_turns=1, messages_from=2)
    first = reg.begin_turn(session, base, b"same request", clock.now())
    second = reg.begin_turn(session, base, b"another request", clock.now())  # no 409 in a tree
    reg.commit_turn(first, record(1, messages_from=2, reply="one"), clock.now())
    reg.commit_turn(second, record(1, messages_from=2, reply="two"), clock.now())
    paths = [*(branch.records for branch in session.branches), tuple(session.records)]
    assert [[r.reply_message["content"] for r in path] for path in paths] == [["ok", "one"], ["ok", "two"]]
    assert paths[0][0] is paths[1][0]  # one parent

    linear = registry()
    plain = linear.create(clock.now())
    commit(linear, clock, plain.session_id, record(0))
    running = linear.begin_turn(plain, base, b"same request", clock.now())
    with pytest.raises(SessionConflict):
        linear.begin_turn(plain, base, b"another request", clock.now())
    twin = linear.begin_turn(plain, base, b"same request", clock.now())  # a client's retry may run beside it
    one, two = (
        dataclasses.replace(record(1, messages_from=2, reply=reply), request_key=b"same request")
        for reply in ("one", "two")
    )
    committed = linear.commit_turn(running, one, clock.now())
    assert linear.commit_turn(twin, two, clock.now()) is committed
    assert [r.reply_message["content"] for r in plain.records] == ["ok", "one"]


def test_a_tree_turn_whose_parent_left_the_current_path_is_a_conflict(
    clock: ManualClock, record: Any
) -> None:
    reg = registry(keep_branches=True)
    session = reg.create(clock.now())
    commit(reg, clock, session.session_id, record(0))
    commit(reg, clock, session.session_id, record(1, messages_from=2))
    deep = reg.begin_turn(
        session, TurnBase(kind=TurnKind.EXTEND, keep_turns=2, messages_from=4), b"a", clock.now()
    )
    root = reg.begin_turn(
        session, TurnBase(kind=TurnKind.ROLLBACK, keep_turns=0, messages_from=0), b"b", clock.now()
    )
    reg.commit_turn(root, record(0, reply="a new root"), clock.now())  # the current path is the new root now
    with pytest.raises(SessionConflict):
        reg.commit_turn(deep, record(2, messages_from=4), clock.now())
