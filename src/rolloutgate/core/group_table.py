"""Groups: the n samples of one prompt (GRPO), tracked from their first arrival to their last end.

Theory of operation: a request that arrives with a group id (`RequestArrived.group`; the front's
`X-Rolloutgate-Group` header or SGLang `/generate`'s `rolloutgate_group` field) joins that group while it
lives. Its siblings are placed together through the session table (session_table.py: the first one
dispatched records the group on its engine with the shared prompt cached). This table knows the live members
of each group, so that aborting a group (`GroupAborted`) reaches every one of them, queued or running, and
when the group's last live member ends it reports the group once (`RecordGroup`): its outcome, the worst of
its members' ends (aborted > failed > finished), and its completion time, from the first member's arrival to
the last member's end (the group's slowest sibling, which is what a GRPO step waits for).

Membership is open: a group is whatever members are live under its id. Siblings are sent together (a GRPO
step submits its n samples at once); a member that arrives after all the earlier ones ended starts the
group afresh, and it is reported again when it ends.

Rules:
1. A request joins at most one group, once (`join`), and leaves it exactly once (`leave`), when it ends.
2. A group is reported exactly once per life, when its last live member leaves; nothing is kept after.
3. Pure bookkeeping: no clock of its own (times come in as arguments), O(1) per join and leave.
"""

from __future__ import annotations

from rolloutgate.core.commands import GroupOutcome, RecordGroup

__all__ = ("GroupTable",)

_RANK = {GroupOutcome.FINISHED: 0, GroupOutcome.FAILED: 1, GroupOutcome.ABORTED: 2}


class _Group:
    __slots__ = ("members", "outcome", "saved_tokens", "started_at", "total")

    def __init__(self, now: float) -> None:
        self.members: dict[str, None] = {}  # live member ids, in arrival order
        self.started_at = now
        self.outcome = GroupOutcome.FINISHED
        self.saved_tokens = 0
        self.total = 0  # members that joined in this life


class GroupTable:
    """Live groups by id."""

    __slots__ = ("_groups",)

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}

    def join(self, group: str, request_id: str, now: float) -> None:
        """`request_id` arrived as a member of `group`. Raises ValueError if it is a member already."""
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = _Group(now)
        if request_id in entry.members:
            raise ValueError(f"request {request_id!r} is already in group {group!r}")
        entry.members[request_id] = None
        entry.total += 1

    def members(self, group: str) -> tuple[str, ...]:
        """The group's live members, in arrival order (empty for an unknown or ended group)."""
        entry = self._groups.get(group)
        return () if entry is None else tuple(entry.members)

    def note_saved(self, group: str, tokens: int) -> None:
        """A member was placed where `tokens` of its prompt are cached thanks to a sibling."""
        entry = self._groups.get(group)
        if entry is not None and tokens > 0:
            entry.saved_tokens += tokens

    def leave(self, group: str, request_id: str, outcome: GroupOutcome, now: float) -> RecordGroup | None:
        """`request_id` ended with `outcome`; the group's record if it was the last live member, else None.
        A request that is not a live member is ignored (None)."""
        entry = self._groups.get(group)
        if entry is None or request_id not in entry.members:
            return None
        del entry.members[request_id]
        if _RANK[outcome] > _RANK[entry.outcome]:
            entry.outcome = outcome
        if entry.members:
            return None
        del self._groups[group]
        return RecordGroup(
            group=group,
            outcome=entry.outcome,
            completion_s=max(0.0, now - entry.started_at),
            members=entry.total,
            prefill_tokens_saved=entry.saved_tokens,
        )

    def __len__(self) -> int:
        return len(self._groups)

    def __repr__(self) -> str:
        live = sum(len(g.members) for g in self._groups.values())
        return f"<GroupTable [{len(self._groups)} groups, {live} live members]>"
