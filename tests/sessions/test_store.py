"""The durable session store (SQLite, WAL): round trips, replaced turns, atomic commits, the state-dir lock."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from rolloutgate.core.clock import ManualClock
from rolloutgate.sessions.errors import SessionStoreUnavailable
from rolloutgate.sessions.record import TurnRecord
from rolloutgate.sessions.registry import SessionLimits, SessionRegistry
from rolloutgate.sessions.session import TurnBase, TurnKind
from rolloutgate.sessions.store import SessionStore, StateDirInUse
from tests.sessions.conftest import make_record


def registry(store: SessionStore | None, **limits: Any) -> SessionRegistry:
    counter = itertools.count()
    return SessionRegistry(SessionLimits(**limits), id_factory=lambda: f"s{next(counter)}", journal=store)


def commit(reg: SessionRegistry, clock: ManualClock, session_id: str, record: TurnRecord, keep: int) -> None:
    session = reg.get(session_id, clock.now())
    base = TurnBase(kind=TurnKind.EXTEND, keep_turns=keep, messages_from=record.messages_from)
    ticket = reg.begin_turn(session, base, record.request_key, clock.now())
    reg.commit_turn(ticket, record, clock.now())


def chain(n: int) -> list[TurnRecord]:
    """n turns, each extending the one before (ids accumulate)."""
    records, length = [], 0
    for index in range(n):
        record = make_record(index, prompt_prefix_len=length, logprobs=[-0.25, -1.5])
        records.append(record)
        length += len(record.prompt_new_ids) + len(record.output_ids)
    return records


def test_records_round_trip_exactly(tmp_path: Path, clock: ManualClock) -> None:
    store = SessionStore(tmp_path)
    reg = registry(store)
    session = reg.create(clock.now())
    records = chain(3)
    for index, record in enumerate(records):
        commit(reg, clock, session.session_id, record, keep=index)
    store.close()

    reopened = SessionStore(tmp_path)
    (stored,) = reopened.load()
    assert stored.session_id == session.session_id
    assert stored.records == tuple(records)  # every field, arrays and bytes included
    restored = registry(reopened)
    restored.restore(stored.session_id, stored.records, clock.now())
    again = restored.get(session.session_id, clock.now())
    assert again.token_ids == session.token_ids
    assert again.state_after(3) == session.state_after(3)
    assert restored.stats().approx_bytes == reg.stats().approx_bytes
    reopened.close()


def test_a_retried_or_rolled_back_turn_replaces_the_stored_ones(tmp_path: Path, clock: ManualClock) -> None:
    store = SessionStore(tmp_path)
    reg = registry(store)
    session_id = reg.create(clock.now()).session_id
    for index, record in enumerate(chain(3)):
        commit(reg, clock, session_id, record, keep=index)
    replacement = make_record(1, prompt_prefix_len=4, reply="another answer")
    commit(reg, clock, session_id, replacement, keep=1)  # turns 1 and 2 go, the new turn 1 stays
    (stored,) = store.load()
    assert [r.reply_message["content"] for r in stored.records] == ["ok", "another answer"]
    assert store.counts() == (1, 2)
    store.close()


def test_deleted_and_evicted_sessions_leave_the_store(tmp_path: Path, clock: ManualClock) -> None:
    store = SessionStore(tmp_path)
    reg = registry(store, idle_ttl_s=10)
    gone, evicted, kept = (reg.create(clock.now()).session_id for _ in range(3))
    for session_id in (gone, evicted, kept):
        commit(reg, clock, session_id, make_record(0), keep=0)
    reg.delete(gone, clock.now())
    clock.advance(5)
    reg.get(kept, clock.now())
    clock.advance(6)
    assert reg.expire(clock.now()) == [evicted]
    assert [s.session_id for s in store.load()] == [kept]
    store.close()


class FailingOn:
    """Wraps the store's connection; raises sqlite3.OperationalError on statements containing `needle`."""

    def __init__(self, db: sqlite3.Connection, needle: str) -> None:
        self.db, self.needle = db, needle

    def execute(self, sql: str, *args: Any) -> Any:
        if self.needle in sql:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def test_a_failed_write_changes_nothing_on_disk_or_in_memory(tmp_path: Path, clock: ManualClock) -> None:
    """The commit's DELETE of the replaced turns runs, then its INSERT fails: the transaction rolls back
    whole (no turn lost, none half-written), the registry keeps its old state, the caller gets a 503."""
    store = SessionStore(tmp_path)
    reg = registry(store)
    session_id = reg.create(clock.now()).session_id
    for index, record in enumerate(chain(2)):
        commit(reg, clock, session_id, record, keep=index)
    real = store._db
    store._db = FailingOn(real, "INSERT INTO turns")  # type: ignore[assignment]
    with pytest.raises(SessionStoreUnavailable) as info:
        commit(reg, clock, session_id, make_record(1, prompt_prefix_len=4, reply="x"), keep=1)
    assert info.value.status == 503 and info.value.headers()["Retry-After"] == "1"
    store._db = real
    assert [r.reply_message["content"] for r in store.load()[0].records] == ["ok", "ok"]
    assert reg.get(session_id, clock.now()).turns == 2
    assert not reg.get(session_id, clock.now()).in_flight
    store.close()


def test_an_unclean_exit_keeps_every_committed_turn(tmp_path: Path, clock: ManualClock) -> None:
    """No close() (the process died): the WAL is replayed on the next open."""
    store = SessionStore(tmp_path)
    reg = registry(store)
    session_id = reg.create(clock.now()).session_id
    for index, record in enumerate(chain(4)):
        commit(reg, clock, session_id, record, keep=index)
    assert (tmp_path / "sessions.sqlite3-wal").stat().st_size > 0
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("sessions.sqlite3", "sessions.sqlite3-wal"):  # what a killed process leaves behind
        (copy / name).write_bytes((tmp_path / name).read_bytes())
    store.close()
    (stored,) = SessionStore(copy).load()
    assert len(stored.records) == 4


def test_one_gateway_per_state_dir(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    with pytest.raises(StateDirInUse):
        SessionStore(tmp_path)
    store.close()
    SessionStore(tmp_path).close()  # free again once closed


def test_an_unreadable_turn_ends_its_chain_there(tmp_path: Path, clock: ManualClock) -> None:
    store = SessionStore(tmp_path)
    reg = registry(store)
    session_id = reg.create(clock.now()).session_id
    for index, record in enumerate(chain(3)):
        commit(reg, clock, session_id, record, keep=index)
    store._db.execute("UPDATE turns SET meta = ? WHERE turn = 1", (b"{not json",))
    (stored,) = store.load()
    assert len(stored.records) == 1
    store.close()
