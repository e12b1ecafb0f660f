"""Groups from their first arrival to their last end (core/group_table.py)."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import GroupOutcome, RecordGroup
from rolloutgate.core.group_table import GroupTable


def test_a_group_is_recorded_once_when_its_last_member_ends_with_its_slowest_siblings_time() -> None:
    table = GroupTable()
    table.join("g", "r1", 10.0)
    table.join("g", "r2", 11.0)
    table.note_saved("g", 20_000)
    assert table.members("g") == ("r1", "r2")
    assert table.leave("g", "r1", GroupOutcome.FINISHED, 50.0) is None
    assert table.leave("g", "r1", GroupOutcome.FINISHED, 51.0) is None  # not a live member any more
    record = table.leave("g", "r2", GroupOutcome.FINISHED, 70.0)
    assert record == RecordGroup(
        group="g", outcome=GroupOutcome.FINISHED, completion_s=60.0, members=2, prefill_tokens_saved=20_000
    )
    assert len(table) == 0 and table.members("g") == ()


@pytest.mark.parametrize(
    ("ends", "outcome"),
    [
        ((GroupOutcome.FINISHED, GroupOutcome.FINISHED, GroupOutcome.FINISHED), GroupOutcome.FINISHED),
        ((GroupOutcome.FINISHED, GroupOutcome.FAILED, GroupOutcome.FINISHED), GroupOutcome.FAILED),
        ((GroupOutcome.ABORTED, GroupOutcome.FAILED, GroupOutcome.FINISHED), GroupOutcome.ABORTED),
        ((GroupOutcome.FAILED, GroupOutcome.FINISHED, GroupOutcome.ABORTED), GroupOutcome.ABORTED),
    ],
)
def test_a_groups_outcome_is_the_worst_of_its_members_ends(
    ends: tuple[GroupOutcome, ...], outcome: GroupOutcome
) -> None:
    table = GroupTable()
    for i in range(len(ends)):
        table.join("g", f"r{i}", 0.0)
    records = [table.leave("g", f"r{i}", end, 1.0) for i, end in enumerate(ends)]
    assert records[:-1] == [None, None]
    last = records[-1]
    assert last is not None and last.outcome is outcome and last.members == 3


def test_a_member_arriving_after_the_group_ended_starts_it_afresh() -> None:
    table = GroupTable()
    table.join("g", "r1", 0.0)
    first = table.leave("g", "r1", GroupOutcome.FAILED, 5.0)
    table.join("g", "r2", 8.0)
    second = table.leave("g", "r2", GroupOutcome.FINISHED, 9.0)
    assert first is not None and second is not None
    assert (second.outcome, second.completion_s, second.members) == (GroupOutcome.FINISHED, 1.0, 1)


def test_joining_twice_is_refused() -> None:
    table = GroupTable()
    table.join("g", "r1", 0.0)
    with pytest.raises(ValueError, match="already in group"):
        table.join("g", "r1", 0.0)
    assert repr(table) == "<GroupTable [1 groups, 1 live members]>"
