"""fleet/replication.py on its own: what an owner sends its backup, in which order, and what a backup that
does not answer costs (links faked; the whole protocol over HTTP is tests/fleet/test_in_process.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from rolloutgate.fleet.assignment import FleetView, mint_session_id
from rolloutgate.fleet.links import ReplicaUnreachable, SessionChange, SessionRemoved, TurnChange
from rolloutgate.fleet.replication import Replication
from rolloutgate.sessions.registry import SessionCopy, SessionLimits, SessionRegistry
from tests.sessions.conftest import make_record


class FakeBackup:
    """A backup's link: records each call's changes; `gate` holds calls until set; `wants` are refused."""

    def __init__(self) -> None:
        self.calls: list[list[SessionChange]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.wants: set[str] = set()
        self.down = False

    async def replicate(self, changes: Sequence[SessionChange], timeout_s: float) -> list[str]:
        if self.down:
            raise ReplicaUnreachable("ActorDiedError", final=True)
        self.calls.append(list(changes))
        await self.gate.wait()
        wanted = [c.session_id for c in changes if isinstance(c, TurnChange) and c.session_id in self.wants]
        self.wants.clear()
        return wanted


def owner_of(registry: SessionRegistry, backup: FakeBackup) -> Replication:
    view = FleetView(
        epoch="e",
        version=1,
        replicas={"replica-0": "http://a", "replica-1": "http://b"},
        engines={},
        owners={},
        handles={"replica-1": backup},
    )
    return Replication("replica-0", registry, lambda: 0.0, lambda: view, lambda handle: handle)  # type: ignore[arg-type, return-value]


def session_with_turns(registry: SessionRegistry, turns: int) -> str:
    """A session named after replica 0 whose copy would be taken as `turns` records."""
    session_id = mint_session_id("replica-0", "ab" * 16)
    records = tuple(dataclasses.replace(make_record(i), request_id=f"r{i}") for i in range(turns))
    registry.take_copy(SessionCopy(session_id=session_id, records=records), 0.0, newer_only=False)
    return session_id


def kinds(call: list[SessionChange]) -> list[Any]:
    return [type(c).__name__ for c in call]


async def test_each_change_goes_to_the_backup_and_a_copy_that_cannot_take_it_gets_the_whole_session() -> None:
    registry, backup = SessionRegistry(SessionLimits()), FakeBackup()
    owner = owner_of(registry, backup)
    sid = session_with_turns(registry, 2)
    backup.wants.add(sid)
    await owner.settle(sid)
    assert [kinds(c) for c in backup.calls] == [["TurnChange"], ["SessionCopy"]]
    turn = backup.calls[0][0]
    assert isinstance(turn, TurnChange) and turn.record.index == 1 and turn.after == "r0"
    whole = backup.calls[1][0]
    assert isinstance(whole, SessionCopy) and len(whole.records) == 2
    registry.drop_copy(sid)
    await owner.settle(sid)
    assert backup.calls[-1] == [SessionRemoved(sid)]


async def test_changes_waiting_for_one_backup_go_in_one_call_in_their_order() -> None:
    registry, backup = SessionRegistry(SessionLimits()), FakeBackup()
    owner = owner_of(registry, backup)
    sid = session_with_turns(registry, 1)
    backup.gate.clear()
    first = asyncio.create_task(owner.settle(sid))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(backup.calls) == 1  # in flight
    second, third = asyncio.create_task(owner.settle(sid)), asyncio.create_task(owner.settle(sid))
    await asyncio.sleep(0)
    assert not second.done()
    backup.gate.set()
    await asyncio.gather(first, second, third)
    assert [len(c) for c in backup.calls] == [1, 2]  # the two that waited, together


async def test_a_backup_that_does_not_answer_costs_redundancy_not_the_turn() -> None:
    registry, backup = SessionRegistry(SessionLimits()), FakeBackup()
    owner = owner_of(registry, backup)
    sid = session_with_turns(registry, 1)
    backup.down = True
    await asyncio.wait_for(owner.settle(sid), timeout=5)  # returns: the agent gets its answer
    assert owner.counts == {"failed": 1}
    backup.down = False
    await owner.settle(sid)
    assert owner.counts == {"failed": 1, "sent": 1}
