"""One session's state: its turns, its current message state and accumulated ids, its turns in flight.

Theory of operation: a `Session` is owned and mutated only by its `SessionRegistry` (registry.py, which holds
the rules); this module keeps the state consistent. `state_after(k)` and `checkpoint(k)` give the state after
the first k turns (cached for k = all turns, rebuilt from the delta-encoded records otherwise), which is what
a new turn extends; `_apply` appends a committed record, dropping rolled-back turns first.

A tree session (miles' v2) keeps what a retry or rollback dropped as a `Branch`: the path from the first turn
to the leaf it left, by reference (records are immutable, so a path costs a pointer a turn). Every committed
record has a sequence number, its commit order (`seqs` beside `records`); the tree's nodes are the records of
the current path and of every branch, its leaves the last record of each.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rolloutgate.sessions.record import TurnRecord, accumulated_ids
from rolloutgate.sessions.render import Checkpoint

__all__ = ("SESSION_OVERHEAD_BYTES", "Branch", "Session", "TurnBase", "TurnKind", "TurnTicket")

SESSION_OVERHEAD_BYTES = 2048


class TurnKind(enum.Enum):
    FIRST = "first"
    EXTEND = "extend"
    RETRY = "retry"
    ROLLBACK = "rollback"
    RESTART = "restart"  # recorded mode only: the messages do not extend the session


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnBase:
    kind: TurnKind
    keep_turns: int  # turns that stay when this one commits; the new record gets index keep_turns
    messages_from: int  # leading request messages shared with the state after keep_turns turns


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnTicket:
    ticket_id: int
    session_id: str
    base: TurnBase
    base_version: int
    request_key: bytes
    base_seqs: tuple[
        int, ...
    ] = ()  # the seqs of the turns it extends: a tree session's sibling commits check them


@dataclass(frozen=True, slots=True)
class Branch:
    """A path the session moved away from: its records from the first turn to the leaf, with their seqs."""

    records: tuple[TurnRecord, ...]
    seqs: tuple[int, ...]


class Session:
    """One session's state. Mutated only by its registry."""

    __slots__ = (
        "_sequence",
        "_state",
        "_state_keys",
        "approx_bytes",
        "branches",
        "created_at",
        "in_flight",
        "last_active_at",
        "max_seq_len",
        "records",
        "seqs",
        "session_id",
        "version",
    )

    def __init__(self, session_id: str, now: float, *, max_seq_len: int | None = None) -> None:
        self.session_id = session_id
        self.created_at = now
        self.max_seq_len = max_seq_len  # the token budget: prompt + generated, per turn (token_budget.py)
        self.last_active_at = now
        self.records: list[TurnRecord] = []
        self.seqs: list[int] = []  # each record's commit order
        self.branches: list[Branch] = []  # tree sessions only
        self.in_flight: dict[int, TurnTicket] = {}
        self.version = 0
        self.approx_bytes = SESSION_OVERHEAD_BYTES
        self._state: list[dict[str, Any]] = []  # S_n: last request's messages + reply
        self._state_keys: list[bytes] = []
        self._sequence: array[int] = array("i")  # last prompt + last output

    @property
    def is_idle(self) -> bool:
        return not self.in_flight

    @property
    def turns(self) -> int:
        return len(self.records)

    @property
    def token_ids(self) -> array[int]:
        return self._sequence

    def state_after(self, turns: int) -> tuple[list[dict[str, Any]], list[bytes]]:
        """S_turns: the messages (and their keys) after the first `turns` turns."""
        if turns == len(self.records):
            return self._state, self._state_keys
        state: list[dict[str, Any]] = []
        keys: list[bytes] = []
        for record in self.records[:turns]:
            state = state[: record.messages_from] + list(record.new_messages) + [record.reply_message]
            keys = keys[: record.messages_from] + list(record.message_keys)
        return state, keys

    def checkpoint(self, turns: int) -> Checkpoint:
        """What a turn keeping `turns` turns extends (messages, ids, last output): a snapshot, so a commit
        while the turn runs upstream does not change it."""
        messages, _ = self.state_after(turns)
        ids = (
            array("i", self._sequence)
            if turns == len(self.records)
            else accumulated_ids(self.records[:turns])
        )
        last_output: Sequence[int] = self.records[turns - 1].output_ids if turns else ()
        return Checkpoint(turns=turns, messages=tuple(messages), token_ids=ids, last_output_ids=last_output)

    def _apply(self, record: TurnRecord, keep: int, *, keep_branch: bool = False) -> list[TurnRecord]:
        """Append `record` after the first `keep` turns; returns the turns it dropped (kept as a Branch when
        `keep_branch`)."""
        dropped = self.records[keep:]
        if dropped:
            if keep_branch:
                self.branches.append(Branch(tuple(self.records), tuple(self.seqs)))
            state, keys = self.state_after(keep)
            self._state, self._state_keys = list(state), list(keys)
            del self.records[keep:]
            del self.seqs[keep:]
            self._sequence = accumulated_ids(self.records)
        self.records.append(record)
        self.seqs.append(self.version)
        del self._state[record.messages_from :]
        del self._state_keys[record.messages_from :]
        self._state.extend(record.new_messages)
        self._state.append(record.reply_message)
        self._state_keys.extend(record.message_keys)
        del self._sequence[record.prompt_prefix_len :]
        self._sequence.extend(record.prompt_new_ids)
        self._sequence.extend(record.output_ids)
        self.version += 1
        return dropped

    def __repr__(self) -> str:
        return (
            f"<Session {self.session_id} [{len(self.records)} turns, {len(self._sequence)} ids, "
            f"{len(self.in_flight)} in flight, ~{self.approx_bytes} B]>"
        )
