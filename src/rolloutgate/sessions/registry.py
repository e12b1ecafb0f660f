"""The session registry: sans-IO (no asyncio, no clock of its own; every time-dependent call takes `now`).

Theory of operation. A session is a linear chain of turns (`TurnRecord`s). A turn runs in three steps, with
no `await` between the first two, so they see one consistent state:

1. `plan_turn(session, keys, tools_key, strict)` decides what the request's messages are to the session
   (rules below) and returns a `TurnBase`: how many turns it keeps and which messages it shares;
2. `begin_turn(...)` marks the turn in flight and returns a `TurnTicket` (the session is then never evicted);
3. `commit_turn(ticket, record)` appends the record (dropping a rolled-back turn), or `end_turn(ticket)`
   forgets a turn that failed. `end_turn` after a commit is a no-op, so callers put it in a `finally`.

The rules for a session holding n turns, whose state S_n is turn n's request messages plus its reply:
- EXTEND: the messages start with S_n (and tools/template kwargs are unchanged): a normal next turn;
- RETRY: the messages equal turn n's request messages: the last turn is retried; it replaces turn n;
- ROLLBACK: the messages start with S_{n-1}: the agent re-ran from the turn before (a different tool result,
  say; for n = 1, with a tokenizer, any other first request); it replaces turn n. At most one turn is ever rolled back (a
  request that would discard more is refused in miles' words: `rollback failed: discard_count=...`);
- tree sessions (`keep_branches`, miles' v2) also branch deeper: from the deepest earlier turn whose state
  the messages start with, or from the root when even the first messages differ; and a turn may not extend
  one cut off at `length` (`TruncatedGeneration`, 409, as miles answers), only retry it;
- otherwise, with a tokenizer (strict): `SessionDiverged` (400); without one (recorded mode) the turn is
  recorded anyway (RESTART), and its trajectory shows where the chain broke.
A rollback takes effect at commit: if the retried turn fails, the old turn stays.

Limits (`SessionLimits`), all enforced here:
- `idle_ttl_s`: a session with no turn in flight and no call for this long is evicted; later calls get
  `SessionEvicted` (410) while its tombstone is kept (the newest `max_tombstones`), then 404;
- `max_sessions` and `max_bytes` (approximate bytes of all records): when a new session or a committed turn
  would pass one, the least recently used idle sessions are evicted (410 afterwards). Policy choice: RL
  frameworks often forget to delete sessions, so a full registry makes room from the stalest sessions
  rather than refuse work; only when every session has a turn in flight does `create` fail with 429
  (`SessionsFull`). With `evict_when_full=False` a full registry always answers 429 instead;
- `max_records_per_session`: a turn beyond it fails with `SessionRecordLimit` (400).
Concurrency inside one session: a second request while a turn is in flight fails with `SessionConflict`
(409, retryable) unless it is the same request (a client retry), which may run and whose commit is then a
duplicate that changes nothing. A tree session (`keep_branches`) takes concurrent turns as miles' v2 does:
each commits, the later ones as siblings of the earlier (their turns before still the current path's), and
its sample picker chooses among the leaves.

Durability: an optional `SessionJournal` (sessions/store.py, with `--state-dir`) hears of every created
session and committed turn BEFORE the change is applied in memory (if it raises, nothing changed), and of
every removed session after. `restore(...)` rebuilds a session from its journaled records at start-up.

Copies (a fleet's backup replica, fleet/replication.py): `copy_of(id)` is a session's whole state as another
registry takes it; `take_copy(copy, newer_only=...)` installs one (a copy pulled from a peer only if it holds
at least as many turns as this registry's own: a backup that served turns while the owner was away has more);
`take_turn(id, record, after)` applies one committed turn on top of the copy held, if that copy's turn before
it is the owner's (`after`, its request id; else False, and the owner sends the whole session); `drop_copy(id)`
forgets one whose owner removed it. Each is journaled like the change it mirrors, so a backup with
`--state-dir` keeps its copies across its own restart. A session with a turn in flight here takes no copy: it
is being served here, and its commit settles which state is current.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutgate.sessions.errors import (
    SessionConflict,
    SessionDiverged,
    SessionEvicted,
    SessionNotFound,
    SessionRecordLimit,
    SessionsFull,
    TruncatedGeneration,
)
from rolloutgate.sessions.messages import describe_difference, first_difference
from rolloutgate.sessions.record import TurnRecord
from rolloutgate.sessions.session import SESSION_OVERHEAD_BYTES, Session, TurnBase, TurnKind, TurnTicket
from rolloutgate.sessions.stats import RegistryStats

__all__ = ("SessionCopy", "SessionJournal", "SessionLimits", "SessionRegistry")


class SessionJournal(Protocol):
    """Where a registry makes its changes durable; each call is one atomic write (sessions/store.py)."""

    def session_created(self, session_id: str) -> None:
        """Raise (e.g. SessionStoreUnavailable) to refuse the session."""
        ...

    def turn_committed(self, session_id: str, record: TurnRecord) -> None:
        """The record replaces the session's turns from `record.index` on. Raise to refuse the commit."""
        ...

    def session_removed(self, session_id: str) -> None:
        """Deleted or evicted. Best effort: must not raise."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCopy:
    """A session's state as another registry takes it: its records in order and its token budget."""

    session_id: str
    records: tuple[TurnRecord, ...]
    max_seq_len: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionLimits:
    max_sessions: int = 10_000
    max_records_per_session: int = 1_000
    idle_ttl_s: float = 3600.0  # math.inf: never
    max_bytes: int = 4 * 1024**3
    max_tombstones: int = 100_000
    evict_when_full: bool = True
    keep_branches: bool = False  # tree sessions (miles' v2): what a retry or rollback drops stays a branch

    def __post_init__(self) -> None:
        if math.isnan(self.idle_ttl_s) or self.idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be > 0 (math.inf for none), got {self.idle_ttl_s!r}")
        for name in ("max_sessions", "max_records_per_session", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_tombstones < 0:
            raise ValueError(f"max_tombstones must be >= 0, got {self.max_tombstones!r}")


class SessionRegistry:
    def __init__(
        self,
        limits: SessionLimits | None = None,
        *,
        id_factory: Callable[[], str] | None = None,
        journal: SessionJournal | None = None,
    ) -> None:
        self.limits = limits or SessionLimits()
        self.journal = journal
        self._new_id = id_factory or (lambda: uuid.uuid4().hex)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently active first
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # evicted id -> reason
        self._tickets = itertools.count(1)
        self._bytes = 0
        self._counters: dict[str, int] = {}

    def mint_ids_with(self, id_factory: Callable[[], str]) -> None:
        """Make new session ids with `id_factory` from now on (a fleet replica names itself in them)."""
        self._new_id = id_factory

    # -- lifecycle -----------------------------------------------------------------------------------------

    def create(self, now: float, *, max_seq_len: int | None = None) -> Session:
        """A new empty session (with its token budget, if any). Raises SessionsFull when at a limit and no idle
        session can be evicted."""
        self.expire(now)
        limits = self.limits
        while (
            len(self._sessions) >= limits.max_sessions
            or self._bytes + SESSION_OVERHEAD_BYTES > limits.max_bytes
        ):
            reason = "capacity" if len(self._sessions) >= limits.max_sessions else "memory"
            if not (limits.evict_when_full and self._evict_lru(reason, keep=None)):
                self._count("rejected_full")
                raise SessionsFull(
                    f"the gateway holds {len(self._sessions)} sessions (~{self._bytes} bytes; limits "
                    f"{limits.max_sessions} sessions, {limits.max_bytes} bytes) and none is idle to evict",
                    retry_after_s=5,
                )
        session = Session(self._new_id(), now, max_seq_len=max_seq_len)
        if self.journal is not None:
            self.journal.session_created(session.session_id)
        self._sessions[session.session_id] = session
        self._bytes += session.approx_bytes
        self._count("created")
        return session

    def restore(self, session_id: str, records: Sequence[TurnRecord], now: float) -> Session:
        """Rebuild a journaled session (start-up): its records in order, idle since `now`. Not journaled.

        Raises ValueError if the records are not the turns 0..n-1 or the id is already live.
        """
        if session_id in self._sessions:
            raise ValueError(f"session {session_id} is already live")
        session = Session(session_id, now)
        for turn, record in enumerate(records):
            if record.index != turn:
                raise ValueError(f"session {session_id}: record {record.index} where turn {turn} belongs")
            session._apply(record, turn)
            session.approx_bytes += _record_cost(record)
        self._sessions[session_id] = session
        self._bytes += session.approx_bytes
        return session

    def get(self, session_id: str, now: float) -> Session:
        """The live session, touched. Raises SessionEvicted (410) or SessionNotFound (404)."""
        session = self._sessions.get(session_id)
        if session is not None and session.is_idle and now - session.last_active_at >= self.limits.idle_ttl_s:
            self._evict(session, "idle_ttl")
            session = None
        if session is None:
            raise self._missing(session_id)
        self._touch(session, now)
        return session

    def delete(self, session_id: str, now: float) -> Session:
        """Remove a session (its in-flight turns will not be recorded). Raises like `get`."""
        session = self.get(session_id, now)
        del self._sessions[session_id]
        self._bytes -= session.approx_bytes
        self._count("deleted")
        if self.journal is not None:
            self.journal.session_removed(session_id)
        return session

    def expire(self, now: float) -> list[str]:
        """Evict every idle session whose TTL has passed; returns their ids (oldest first)."""
        ttl = self.limits.idle_ttl_s
        expired = [
            s
            for s in itertools.takewhile(lambda s: now - s.last_active_at >= ttl, self._sessions.values())
            if s.is_idle
        ]
        for session in expired:
            self._evict(session, "idle_ttl")
        return [s.session_id for s in expired]

    def next_expiry_at(self) -> float:
        """When the next idle session's TTL runs out (math.inf if none can expire)."""
        oldest = next((s for s in self._sessions.values() if s.is_idle), None)
        return math.inf if oldest is None else oldest.last_active_at + self.limits.idle_ttl_s

    # -- turns ---------------------------------------------------------------------------------------------

    def plan_turn(
        self,
        session: Session,
        messages: Sequence[dict[str, Any]],
        keys: Sequence[bytes],
        tools_key: bytes,
        *,
        strict: bool,
    ) -> TurnBase:
        """Decide how a request with these messages (and their keys) relates to the session (module rules).

        Raises SessionDiverged when `strict` and the request neither extends nor retries the session.
        """
        base = self._plan(session, messages, keys, tools_key, strict=strict)
        cut = session.records[base.keep_turns - 1] if base.keep_turns else None
        if (
            self.limits.keep_branches
            and base.kind is not TurnKind.RETRY
            and cut
            and cut.finish_reason == "length"
        ):
            self._count("truncated")
            raise TruncatedGeneration(
                f"truncated generation cannot be extended: turn {base.keep_turns - 1} of session "
                f"{session.session_id} was cut off at its length limit (retry that turn, or branch from an "
                "earlier one)"
            )
        return base

    def _plan(
        self,
        session: Session,
        messages: Sequence[dict[str, Any]],
        keys: Sequence[bytes],
        tools_key: bytes,
        *,
        strict: bool,
    ) -> TurnBase:
        records = session.records
        n = len(records)
        if n == 0:
            return TurnBase(kind=TurnKind.FIRST, keep_turns=0, messages_from=0)
        state, state_keys = session.state_after(n)
        last = records[-1]
        if last.tools_key == tools_key and _common_prefix(keys, state_keys) == len(state_keys):
            return TurnBase(kind=TurnKind.EXTEND, keep_turns=n, messages_from=len(state_keys))
        previous_keys = session.state_after(n - 1)[1]
        if last.tools_key == tools_key and list(keys) == state_keys[:-1]:
            shared = _common_prefix(keys, previous_keys)
            return TurnBase(kind=TurnKind.RETRY, keep_turns=n - 1, messages_from=shared)
        one_turn_back = n >= 2 and records[-2].tools_key == tools_key
        # strict, n == 1: back to the empty session, a new first turn (miles: the empty checkpoint); recorded
        # mode keeps such a turn after the first instead (RESTART: its trajectory shows the break)
        if (one_turn_back or (n == 1 and strict)) and _common_prefix(keys, previous_keys) == len(
            previous_keys
        ):
            return TurnBase(kind=TurnKind.ROLLBACK, keep_turns=n - 1, messages_from=len(previous_keys))
        if self.limits.keep_branches:
            branch = _deepest_branch_point(session, keys, tools_key)
            if branch is not None:
                return branch
        shared = _common_prefix(keys, state_keys)
        if not strict:
            return TurnBase(kind=TurnKind.RESTART, keep_turns=n, messages_from=shared)
        self._count("diverged")
        if shared == len(state_keys):
            detail = "its tools or chat_template_kwargs differ from the session's"
        else:
            discarded = n - _turns_within(session, shared)
            if discarded > 1:  # miles' own words for it (linear_trajectory.py), which its pins read
                raise SessionDiverged(
                    f"rollback failed: discard_count={discarded} exceeds max_assistant_rollback_steps=1 "
                    f"(stored has {len(state)} messages, request has {len(messages)} messages)"
                )
            detail = describe_difference(state, messages, shared)
        raise SessionDiverged(
            f"the request does not extend session {session.session_id}: {detail}. A session is one linear "
            "conversation: send its history exactly as returned plus new messages, retry the last request "
            "unchanged, or start a new session"
        )

    def begin_turn(self, session: Session, base: TurnBase, request_key: bytes, now: float) -> TurnTicket:
        """Mark a turn in flight. Raises SessionConflict (another request in flight) or SessionRecordLimit."""
        if self._sessions.get(session.session_id) is not session:
            raise self._missing(session.session_id)
        if not self.limits.keep_branches and any(
            t.request_key != request_key for t in session.in_flight.values()
        ):
            self._count("busy")
            raise SessionConflict(
                f"session {session.session_id} has another request in flight; a session's turns are sequential",
                retry_after_s=1,
            )
        if base.keep_turns + 1 + len(session.branches) > self.limits.max_records_per_session:
            self._count("record_limit")
            raise SessionRecordLimit(
                f"session {session.session_id} holds its maximum of {self.limits.max_records_per_session} turns "
                "(a tree session's branches included)"
            )
        ticket = TurnTicket(
            ticket_id=next(self._tickets),
            session_id=session.session_id,
            base=base,
            base_version=session.version,
            request_key=request_key,
            base_seqs=tuple(session.seqs[: base.keep_turns]),
        )
        session.in_flight[ticket.ticket_id] = ticket
        self._touch(session, now)
        return ticket

    def commit_turn(self, ticket: TurnTicket, record: TurnRecord, now: float) -> TurnRecord:
        """Record the finished turn and return the session's record of it.

        A retried request whose twin committed first returns the twin's record (nothing changes). Raises
        SessionEvicted/SessionNotFound if the session went away meanwhile, SessionConflict if it changed.
        """
        session = self._sessions.get(ticket.session_id)
        if session is None:
            raise self._missing(ticket.session_id)
        session.in_flight.pop(ticket.ticket_id, None)
        self._touch(session, now)
        if (
            session.version != ticket.base_version
            and self.limits.keep_branches
            and tuple(session.seqs[: ticket.base.keep_turns]) == ticket.base_seqs
        ):
            pass  # a tree: a turn whose base is still on the current path is a sibling of what committed since
        elif session.version != ticket.base_version:
            last = session.records[-1] if session.records else None
            if (
                last is not None
                and last.index == ticket.base.keep_turns
                and last.request_key == ticket.request_key
            ):
                self._count("duplicate_commits")
                return last
            raise SessionConflict(
                f"session {session.session_id} changed while this turn ran; it was not recorded"
            )
        if record.index != ticket.base.keep_turns:
            raise ValueError(f"record index {record.index} != the ticket's turn {ticket.base.keep_turns}")
        dropped = self._append(session, record, ticket.base.keep_turns)
        self._count("committed")
        if dropped:
            self._count("rolled_back", len(dropped))
        while self._bytes > self.limits.max_bytes and self._evict_lru("memory", keep=session.session_id):
            pass
        return record

    def end_turn(self, ticket: TurnTicket, now: float) -> None:
        """Forget a turn that will not be committed (failed, cancelled). No-op after commit."""
        session = self._sessions.get(ticket.session_id)
        if session is not None and session.in_flight.pop(ticket.ticket_id, None) is not None:
            self._count("abandoned")
            self._touch(session, now)

    # -- copies (module docstring) ---------------------------------------------------------------------------

    def copy_of(self, session_id: str) -> SessionCopy | None:
        """The live session's state, or None if this registry does not hold it."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        return SessionCopy(
            session_id=session_id, records=tuple(session.records), max_seq_len=session.max_seq_len
        )

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def take_copy(self, copy: SessionCopy, now: float, *, newer_only: bool) -> bool:
        """Install `copy` in place of this registry's own (journaled); False when the own one has a turn in
        flight, or (`newer_only`) holds more turns than the copy."""
        own = self._sessions.get(copy.session_id)
        if own is not None and (not own.is_idle or (newer_only and len(own.records) > len(copy.records))):
            return False
        if own is not None:
            del self._sessions[copy.session_id]
            self._bytes -= own.approx_bytes
        if self.journal is not None:
            self.journal.session_removed(copy.session_id)
            self.journal.session_created(copy.session_id)
            for record in copy.records:
                self.journal.turn_committed(copy.session_id, record)
        session = self.restore(copy.session_id, copy.records, now)
        session.max_seq_len = copy.max_seq_len
        self._tombstones.pop(copy.session_id, None)
        self._count("copies_taken")
        return True

    def take_turn(self, session_id: str, record: TurnRecord, after: str | None, now: float) -> bool:
        """Apply one turn its owner committed on top of the copy held; `after`: the request id of the owner's
        turn before it (None for a first turn). True if applied or held already; False if this copy cannot
        take it (absent, busy, or its turns before it are not the owner's): the owner sends the whole session."""
        session = self._sessions.get(session_id)
        if session is None or not session.is_idle:
            return False
        records, index = session.records, record.index
        if index < len(records) and records[index].request_id == record.request_id:
            return True  # held already (a repeated send)
        if len(records) < index or (index and records[index - 1].request_id != after):
            return False
        self._append(session, record, index)
        self._touch(session, now)
        self._count("copy_turns_taken")
        return True

    def drop_copy(self, session_id: str) -> None:
        """Forget the copy of a session its owner deleted or evicted (no tombstone: the owner answers for it)."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        self._bytes -= session.approx_bytes
        if self.journal is not None:
            self.journal.session_removed(session_id)

    # -- observability -------------------------------------------------------------------------------------

    def stats(self) -> RegistryStats:
        sessions = self._sessions.values()
        c = self._counters.get
        return RegistryStats(
            sessions=len(self._sessions),
            sessions_busy=sum(1 for s in sessions if not s.is_idle),
            turns_in_flight=sum(len(s.in_flight) for s in sessions),
            records=sum(len(s.records) for s in sessions),
            approx_bytes=self._bytes,
            max_sessions=self.limits.max_sessions,
            max_records_per_session=self.limits.max_records_per_session,
            idle_ttl_s=self.limits.idle_ttl_s,
            max_bytes=self.limits.max_bytes,
            created_total=c("created", 0),
            deleted_total=c("deleted", 0),
            evicted_idle_ttl_total=c("evicted_idle_ttl", 0),
            evicted_capacity_total=c("evicted_capacity", 0),
            evicted_memory_total=c("evicted_memory", 0),
            rejected_full_total=c("rejected_full", 0),
            turns_committed_total=c("committed", 0),
            turns_abandoned_total=c("abandoned", 0),
            turns_rolled_back_total=c("rolled_back", 0),
            duplicate_commits_total=c("duplicate_commits", 0),
            diverged_total=c("diverged", 0),
            busy_total=c("busy", 0),
            record_limit_total=c("record_limit", 0),
        )

    def __len__(self) -> int:
        return len(self._sessions)

    def __repr__(self) -> str:
        return f"<SessionRegistry [{len(self._sessions)} sessions, ~{self._bytes} B]>"

    # -- internals -----------------------------------------------------------------------------------------

    def _append(self, session: Session, record: TurnRecord, keep_turns: int) -> list[TurnRecord]:
        """Journal the record (durable first: the journal may refuse), then append it after `keep_turns`
        turns and count its bytes; returns the turns it dropped."""
        if self.journal is not None:
            self.journal.turn_committed(session.session_id, record)
        keep_branch = self.limits.keep_branches
        dropped = session._apply(record, keep_turns, keep_branch=keep_branch)
        delta = _record_cost(record) - (0 if keep_branch else sum(_record_cost(r) for r in dropped))
        session.approx_bytes += delta
        self._bytes += delta
        return dropped

    def _touch(self, session: Session, now: float) -> None:
        session.last_active_at = max(session.last_active_at, now)
        self._sessions.move_to_end(session.session_id)

    def _count(self, name: str, by: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + by

    def _missing(self, session_id: str) -> SessionEvicted | SessionNotFound:
        reason = self._tombstones.get(session_id)
        if reason is not None:
            return SessionEvicted(f"session {session_id} was evicted ({reason.replace('_', ' ')})")
        return SessionNotFound(f"session not found: session_id={session_id}")

    def _evict(self, session: Session, reason: str) -> None:
        del self._sessions[session.session_id]
        self._bytes -= session.approx_bytes
        self._count(f"evicted_{reason}")
        if self.journal is not None:
            self.journal.session_removed(session.session_id)
        if self.limits.max_tombstones:
            self._tombstones[session.session_id] = reason
            while len(self._tombstones) > self.limits.max_tombstones:
                self._tombstones.popitem(last=False)

    def _evict_lru(self, reason: str, *, keep: str | None) -> bool:
        victim = next((s for s in self._sessions.values() if s.is_idle and s.session_id != keep), None)
        if victim is None:
            return False
        self._evict(victim, reason)
        return True


def _deepest_branch_point(session: Session, keys: Sequence[bytes], tools_key: bytes) -> TurnBase | None:
    """Tree sessions (miles' v2): the deepest earlier turn whose state the messages extend, as a branch from
    there (turn 0: a new root, for a request whose first messages differ); None if none is (the turn before
    the last is the linear rules' rollback, judged the same way)."""
    records = session.records
    for keep in range(len(records) - 1, -1, -1):
        if keep and records[keep - 1].tools_key != tools_key:
            continue
        state_keys = session.state_after(keep)[1]
        if _common_prefix(keys, state_keys) == len(state_keys):
            return TurnBase(kind=TurnKind.ROLLBACK, keep_turns=keep, messages_from=len(state_keys))
    return None


def _turns_within(session: Session, shared: int) -> int:
    """How many of the session's turns end (their answer included) within its first `shared` messages."""
    for turns in range(len(session.records), 0, -1):
        if len(session.state_after(turns)[1]) <= shared:
            return turns
    return 0


def _record_cost(record: TurnRecord) -> int:
    """What a record counts against `max_bytes` (its own estimate + the accumulated ids it adds)."""
    return record.approx_bytes + 4 * (len(record.prompt_new_ids) + len(record.output_ids))


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    at = first_difference(a, b)
    return min(len(a), len(b)) if at is None else at
