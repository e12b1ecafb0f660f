"""Durable session records: an embedded SQLite database (WAL mode) under `--state-dir`.

Theory of operation: the registry (sans-IO) tells its `SessionJournal` about every change that must survive a
restart, and this store makes each one durable before the registry applies it in memory:

- `session_created(id)`: one row in `sessions`;
- `turn_committed(id, record)`: in ONE transaction, the session's turns from `record.index` on are deleted (a
  retried or rolled-back turn replaces them) and the record is inserted. SQLite commits a transaction whole or
  not at all (the WAL is replayed or discarded on the next open), so a crash at any instant leaves every
  record either absent or complete: never half-written;
- `session_removed(id)` (deleted or evicted): the session and its turns go, in one transaction.

A record is written before the agent gets its answer (`commit_turn` calls the journal first): an answer the
agent received is a record on disk. With `synchronous=NORMAL` (the default) a committed transaction survives
the process being killed (kill -9, OOM); only an operating-system crash or power loss may roll back the last
transactions. `synchronous="FULL"` closes that gap too, at the cost of an fsync per turn.

Writes run synchronously on the caller's thread (the event loop): a WAL commit without fsync takes tens of
microseconds, which is cheaper than a thread hop and keeps "answered = on disk" exact.

Layout: `<state-dir>/sessions.sqlite3` (+ `-wal`, `-shm`) and `<state-dir>/sessions.lock`, an exclusive
`flock` held while the store is open, so two gateways never share one state dir (the OS releases it if the
process dies). Token ids and logprobs are stored as little-endian binary arrays; everything else as JSON.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson

from rolloutgate.sessions.errors import SessionStoreUnavailable
from rolloutgate.sessions.record import TurnRecord

__all__ = ("SCHEMA_VERSION", "SessionStore", "StateDirInUse", "StoredSession")

log = logging.getLogger("rolloutgate.sessions.store")

SCHEMA_VERSION = 1
DB_NAME = "sessions.sqlite3"
LOCK_NAME = "sessions.lock"
_ARRAY_FIELDS = {"prompt_new_ids": "i", "output_ids": "i", "output_logprobs": "d"}
_BYTES_FIELDS = ("request_key", "tools_key")
_META_FIELDS = tuple(f.name for f in fields(TurnRecord) if f.init and f.name not in _ARRAY_FIELDS)
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS turns ("
    " session_id TEXT NOT NULL, turn INTEGER NOT NULL, meta BLOB NOT NULL,"
    " prompt_new_ids BLOB NOT NULL, output_ids BLOB NOT NULL, output_logprobs BLOB NOT NULL,"
    " PRIMARY KEY (session_id, turn)) WITHOUT ROWID",
)


class StateDirInUse(RuntimeError):
    """Another process holds the state dir's lock."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredSession:
    session_id: str
    records: tuple[TurnRecord, ...]


class SessionStore:
    """One open store; implements the registry's `SessionJournal`. Not thread-safe (one event loop)."""

    def __init__(self, state_dir: str | Path, *, synchronous: str = "NORMAL") -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock(self.state_dir / LOCK_NAME)
        try:
            self._db = sqlite3.connect(
                self.state_dir / DB_NAME, isolation_level=None, check_same_thread=False
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise RuntimeError(
                    f"{self.path} has schema version {version}; this gateway reads {SCHEMA_VERSION}"
                )
            with self._transaction():
                for statement in _SCHEMA:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.writes = 0

    @property
    def path(self) -> Path:
        return self.state_dir / DB_NAME

    # -- reading (start-up) ---------------------------------------------------------------------------------

    def load(self) -> list[StoredSession]:
        """Every stored session with its turns in order. A turn that cannot be decoded ends its session's
        chain there (logged): the turns before it are kept, since each extends the one before."""
        sessions: dict[str, list[TurnRecord]] = {
            sid: [] for (sid,) in self._db.execute("SELECT session_id FROM sessions")
        }
        broken: set[str] = set()
        rows = self._db.execute(
            "SELECT session_id, turn, meta, prompt_new_ids, output_ids, output_logprobs"
            " FROM turns ORDER BY session_id, turn"
        )
        for session_id, turn, meta, prompt_ids, output_ids, logprobs in rows:
            chain = sessions.setdefault(session_id, [])
            if session_id in broken:
                continue
            try:
                if turn != len(chain):
                    raise ValueError(f"turn {turn} follows {len(chain)} turns")
                chain.append(_decode(meta, prompt_ids, output_ids, logprobs))
            except (ValueError, TypeError, KeyError, orjson.JSONDecodeError) as exc:
                broken.add(session_id)
                log.error(
                    "session %s: stored turn %s is unreadable (%s); keeping %d turns",
                    session_id,
                    turn,
                    exc,
                    len(chain),
                )
        return [StoredSession(session_id=sid, records=tuple(chain)) for sid, chain in sessions.items()]

    def counts(self) -> tuple[int, int]:
        """(sessions, turns) on disk."""
        sessions = self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        turns = self._db.execute("SELECT COUNT(*) FROM turns").fetchone()[0]
        return int(sessions), int(turns)

    # -- the journal (registry.SessionJournal) --------------------------------------------------------------

    def session_created(self, session_id: str) -> None:
        with self._writing("create session"), self._transaction():
            self._db.execute("INSERT OR IGNORE INTO sessions (session_id) VALUES (?)", (session_id,))

    def turn_committed(self, session_id: str, record: TurnRecord) -> None:
        row = _encode(record)
        with self._writing("record a turn"), self._transaction():
            self._db.execute("INSERT OR IGNORE INTO sessions (session_id) VALUES (?)", (session_id,))
            self._db.execute(
                "DELETE FROM turns WHERE session_id = ? AND turn >= ?", (session_id, record.index)
            )
            self._db.execute(
                "INSERT INTO turns (session_id, turn, meta, prompt_new_ids, output_ids, output_logprobs)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, record.index, *row),
            )

    def session_removed(self, session_id: str) -> None:
        """Best effort: a removal that fails is logged, not raised (the session may reappear after a
        restart, which loses nothing)."""
        try:
            with self._writing("remove a session"), self._transaction():
                self._db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
                self._db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
        except SessionStoreUnavailable as exc:
            log.error("%s", exc.message)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Checkpoint the WAL into the database file, close, and release the state dir."""
        if self._lock_fd < 0:
            return
        with contextlib.suppress(sqlite3.Error):
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()
        os.close(self._lock_fd)
        self._lock_fd = -1

    def __repr__(self) -> str:
        return f"<SessionStore {self.path} [{self.writes} writes]>"

    # -- internals ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        if self._lock_fd < 0:
            raise SessionStoreUnavailable(f"cannot {what}: the session store is closed")
        try:
            yield
        except sqlite3.Error as exc:
            raise SessionStoreUnavailable(f"cannot {what} in {self.path}: {exc}") from exc
        self.writes += 1


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirInUse(f"{path.parent} is in use by another gateway (it holds {path.name})") from None
    return fd


def _encode(record: TurnRecord) -> tuple[bytes, bytes, bytes, bytes]:
    meta: dict[str, Any] = {name: getattr(record, name) for name in _META_FIELDS}
    for name in _BYTES_FIELDS:
        meta[name] = meta[name].hex()
    meta["message_keys"] = [key.hex() for key in record.message_keys]
    return (
        orjson.dumps(meta),
        _array_bytes(record.prompt_new_ids),
        _array_bytes(record.output_ids),
        _array_bytes(record.output_logprobs),
    )


def _decode(meta_blob: bytes, prompt_ids: bytes, output_ids: bytes, logprobs: bytes) -> TurnRecord:
    meta = orjson.loads(meta_blob)
    for name in _BYTES_FIELDS:
        meta[name] = bytes.fromhex(meta[name])
    meta["message_keys"] = tuple(bytes.fromhex(key) for key in meta["message_keys"])
    meta["new_messages"] = tuple(meta["new_messages"])
    return TurnRecord(
        **meta,
        prompt_new_ids=_array_of("i", prompt_ids),
        output_ids=_array_of("i", output_ids),
        output_logprobs=_array_of("d", logprobs),
    )


def _array_bytes(values: array[Any]) -> bytes:
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def _array_of(typecode: str, raw: bytes) -> array[Any]:
    values = array(typecode)
    values.frombytes(raw)  # ValueError if the length is not a multiple of the item size
    if sys.byteorder != "little":
        values.byteswap()
    return values
