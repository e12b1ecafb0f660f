"""Session records on two replicas: a session's owner hands every change to its backup before the agent hears
of it, so a replica that dies, for good or until Ray restarts it, takes no session record with it.

Theory of operation. A session's replicas in order (`FleetView.preference`): the one its id names, then the
others by the key's rendezvous weight, the order `key_owner` follows when it passes over a dead owner. The
first two live ones are the session's owner and its backup; when the owner dies the backup is its new owner
and already holds every record.

- After each change the session service awaits `settle(id)` (sessions/service.py): the replica sends the
  change (the new turn with the request id of the turn before it, the whole session when new or when the
  backup cannot take the turn, or a removal) to the session's first two live replicas other than itself, and
  returns once each answered or `SEND_TIMEOUT_S` passed: a backup that does not answer costs redundancy,
  never the agent's turn (logged and counted). Each target's changes go in order, in one call as many as
  wait (a whole session is taken as it is when sent), so a copy never arrives older than a change after it.
- A view change makes the owner of each session it holds send the whole session to a replica that became one
  of the two (the new backup, after one died).
- A replica that (re)joins pulls, before it serves any session (`ready`), the copies its peers hold of the
  sessions it is now one of the two of (`copies_for`); a pulled copy replaces its own only if it has at least
  as many turns (a backup that served turns while the owner was away has more).
- The receiving registry applies each change by its own rules (sessions/registry.py, "Copies"): a session
  with a turn in flight there takes no copy, since it is served there.

A copy left on a replica that is no longer one of a session's two (after a replica returned) ends with its
idle TTL. Why copies on replicas rather than a store the fleet shares: docs/fleet.md, with the measurement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.fleet.assignment import FleetView
from rolloutgate.fleet.links import ReplicaLink, ReplicaUnreachable, SessionChange, SessionRemoved, TurnChange
from rolloutgate.sessions.registry import SessionCopy, SessionRegistry

__all__ = ("Replication",)

log = logging.getLogger("rolloutgate.fleet")

SEND_TIMEOUT_S = 5.0  # a backup slower than this is skipped for this change (the next one resends whole)
PULL_TIMEOUT_S = 10.0  # a peer that does not hand its copies over in this long is passed over
COPIES_PER_CALL = 64  # changes per call at most (a view change may send many whole sessions)


@dataclass(eq=False)
class Replication:
    """One replica's side (module docstring). `link_of(handle)`: a peer's link from the handle in the view."""

    replica_id: str
    registry: SessionRegistry
    now: Callable[[], float]
    view: Callable[[], FleetView]
    link_of: Callable[[object], ReplicaLink]
    counts: dict[str, int] = field(default_factory=dict)
    _ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _background: set[asyncio.Task[Any]] = field(default_factory=set, init=False)
    # per target, its changes waiting to be sent: a change, or a session id to send whole
    _outboxes: dict[str, list[tuple[SessionChange | str, asyncio.Future[None]]]] = field(
        default_factory=dict, init=False
    )

    # -- the owner's side ----------------------------------------------------------------------------------------

    async def settle(self, session_id: str) -> None:
        """Hand the session's latest change to its other replicas (module docstring)."""
        targets = self._targets(self.view(), session_id)
        if targets:
            change = self._change_of(session_id)
            await asyncio.gather(*(self._post(target, change) for target in targets))

    def view_changed(self, old: FleetView, new: FleetView) -> None:
        """Send whole sessions to the replicas that became one of their two, for the sessions this one owns."""
        sent: dict[str, int] = {}
        for session_id in self.registry.session_ids():
            order = new.preference(session_id)
            if not order or order[0] != self.replica_id:
                continue
            before = set(self._targets(old, session_id))
            for target in order[1:2]:
                if target not in before:
                    self._post(target, session_id)  # whole, as it is when it is sent
                    sent[target] = sent.get(target, 0) + 1
        for target, count in sent.items():
            log.info("replica %s: %d sessions to their new backup %s", self.replica_id, count, target)

    def _targets(self, view: FleetView, session_id: str) -> list[str]:
        return [r for r in view.preference(session_id)[:2] if r != self.replica_id]

    def _change_of(self, session_id: str) -> SessionChange:
        copy = self.registry.copy_of(session_id)
        if copy is None:
            return SessionRemoved(session_id)
        if not copy.records:
            return copy
        last = copy.records[-1]
        after = copy.records[last.index - 1].request_id if last.index else None
        return TurnChange(session_id, last, after)

    def _whole(self, session_id: str) -> SessionChange:
        return self.registry.copy_of(session_id) or SessionRemoved(session_id)

    def _post(self, target: str, change: SessionChange | str) -> asyncio.Future[None]:
        """Queue a change for `target` (a session id: that session whole, as it is when sent); resolved once
        `target` took it or did not answer. Each target's changes go in order, as many per call as wait."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        outbox = self._outboxes.setdefault(target, [])
        outbox.append((change, done))
        if len(outbox) == 1:
            self._spawn(self._drain(target, outbox))
        return done

    async def _drain(
        self, target: str, outbox: list[tuple[SessionChange | str, asyncio.Future[None]]]
    ) -> None:
        try:
            while outbox:
                batch = outbox[:COPIES_PER_CALL]
                changes = [self._whole(c) if isinstance(c, str) else c for c, _ in batch]
                await self._send(target, changes)
                del outbox[: len(batch)]
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            for _, done in outbox:  # cancelled (the replica stops): nobody waits in vain
                if not done.done():
                    done.set_result(None)
            outbox.clear()

    async def _send(self, target: str, changes: Sequence[SessionChange]) -> None:
        handle = self.view().handles.get(target)
        if handle is None:
            return
        link = self.link_of(handle)
        try:
            wanted = await link.replicate(changes, SEND_TIMEOUT_S)
            whole = [self._whole(sid) for sid in wanted]
            if whole:  # the backup's copy could not take a turn: the whole session instead
                await link.replicate(whole, SEND_TIMEOUT_S)
            self._count("sent", len(changes) + len(whole))
        except ReplicaUnreachable as exc:
            self._count("failed", len(changes))
            log.warning(
                "replica %s: backup %s did not take %d changes (%s)",
                self.replica_id,
                target,
                len(changes),
                exc,
            )

    # -- the backup's side ---------------------------------------------------------------------------------------

    def receive(self, changes: Sequence[SessionChange]) -> list[str]:
        """Apply another replica's changes; returns the sessions whose copy here could not take a turn."""
        now, registry, wanted = self.now(), self.registry, []
        for change in changes:
            if isinstance(change, SessionRemoved):
                registry.drop_copy(change.session_id)
            elif isinstance(change, SessionCopy):
                registry.take_copy(change, now, newer_only=False)
            elif not registry.take_turn(change.session_id, change.record, change.after, now):
                wanted.append(change.session_id)
        self._count("received", len(changes))
        return wanted

    def copies_for(self, replica_id: str, replicas: Sequence[str]) -> list[SessionCopy]:
        """The copies held here of the sessions `replica_id` is one of the two of, in a view of `replicas`."""
        view = FleetView(epoch="", version=0, replicas=dict.fromkeys(replicas, ""), engines={}, owners={})
        held = (self.registry.copy_of(sid) for sid in self.registry.session_ids())
        return [c for c in held if c is not None and replica_id in view.preference(c.session_id)[:2]]

    # -- joining -------------------------------------------------------------------------------------------------

    async def pull(self) -> None:
        """Take the peers' copies of this replica's sessions, then serve sessions (`ready`)."""
        view = self.view()
        peers = {r: h for r, h in view.handles.items() if r != self.replica_id}
        replicas = list(view.key_candidates)
        taken = 0
        try:
            results = await asyncio.gather(
                *(
                    self.link_of(h).copies_for(self.replica_id, replicas, PULL_TIMEOUT_S)
                    for h in peers.values()
                ),
                return_exceptions=True,
            )
            now = self.now()
            for peer, result in zip(peers, results, strict=True):
                if isinstance(result, BaseException):
                    log.warning("replica %s: no copies from %s (%s)", self.replica_id, peer, result)
                    continue
                taken += sum(self.registry.take_copy(c, now, newer_only=True) for c in result)
        finally:
            self._ready.set()
        self._count("pulled", taken)
        if taken:
            log.info("replica %s took %d sessions back from its peers", self.replica_id, taken)

    async def ready(self) -> None:
        await self._ready.wait()

    def _count(self, name: str, by: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + by

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
