"""The fleet's controller: the replica registry, the engine assignment, and the view replicas follow.

Theory of operation: one controller per fleet (a Ray actor, fleet/actors.py; a plain object in tests). It
holds the `Assignment` (fleet/assignment.py), each live replica's URL, incarnation and link, and a version
number that grows with every change. Replicas long-poll `next_view(version)`: the call returns as soon as the
version passes theirs (or after `timeout_s` with the same view), so a change reaches every replica in one
round trip, with no push fan-out to get wrong.

Liveness is Ray's own: every `ping_interval_s` the controller pings each replica. A call to an actor that died
(or that Ray is restarting) raises at once, and the replica is taken out: its engines go to the others in the
same step. A ping that times out counts as a failure; `ping_failures` in a row take the replica out too (a
process that hangs). A ping answered by another incarnation (Ray restarted it between two pings) takes the
old one out; the new one registers itself when it starts, and the balance rule gives it its share back.

A controller that Ray restarts starts a new epoch with only the engines it was started with; each replica
notices the new epoch and registers again with the engines it holds, so engines registered over HTTP since
are kept (each with the replica that had it, where balance allows).

Start-up: the engines given at start are held back until `expected_replicas` have registered (or
`startup_grace_s` has passed), then spread over them in one step, so no early replica takes every engine only
to hand most of them over as the others arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rolloutgate.fleet.assignment import Assignment, EngineEntry, FleetView, Move, engine_fleet_id
from rolloutgate.fleet.links import (
    EngineChange,
    JoinResult,
    ReplicaInfo,
    ReplicaLink,
    ReplicaUnreachable,
)
from rolloutgate.fleet.operations import (
    UPDATE_BEGIN,
    UPDATE_FINISH,
    ReplicaResult,
    compose,
    missing_engines,
    operation_named,
)
from rolloutgate.server.answer import Answer

__all__ = ("FleetController",)

log = logging.getLogger("rolloutgate.fleet")


class FleetController:
    """See the module docstring. `link_factory` makes a `ReplicaLink` of the handle a replica registers with
    (on Ray: its actor handle; in one process: the replica itself)."""

    def __init__(
        self,
        engines: Iterable[EngineEntry] = (),
        *,
        link_factory: Callable[[object], ReplicaLink],
        ping_interval_s: float = 0.5,
        ping_timeout_s: float = 1.0,
        ping_failures: int = 2,
        expected_replicas: int = 1,
        startup_grace_s: float = 30.0,
    ) -> None:
        self.epoch = uuid.uuid4().hex
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.ping_failures = ping_failures
        self._link_factory = link_factory
        self._assignment = Assignment()
        self._entries: dict[str, EngineEntry] = {}
        self._urls: dict[str, str] = {}  # live replica -> URL
        self._previous_urls: dict[str, str] = {}  # every replica ever registered -> its last URL
        self._incarnations: dict[str, str] = {}
        self._links: dict[str, ReplicaLink] = {}
        self._handles: dict[str, object] = {}  # what each replica registered with, for its peers
        self._weight_versions: dict[str, str | None] = {}  # engine URL -> its label, as its owner last said
        self._failures: dict[str, int] = {}
        self._version = 0
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._release_timer: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        self.departures: list[tuple[str, str]] = []  # (replica id, why): what the monitor saw
        self.moves: list[Move] = []  # every engine that changed owner, for the log and for tests
        # the engines given at start wait until the replicas expected at start have registered (or the grace
        # has passed), then are spread over them at once: no replica takes them all and hands most back
        self._held = {entry.url: entry for entry in engines}
        self._expected_replicas = expected_replicas
        self._startup_grace_s = startup_grace_s
        self._view = self._snapshot()

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="fleet-liveness")
            if self._held:
                self._release_timer = asyncio.create_task(self._release_after_grace(), name="fleet-startup")

    async def _release_after_grace(self) -> None:
        await asyncio.sleep(self._startup_grace_s)
        if self._held:
            log.warning(
                "%d of %d replicas registered in %g s: the engines given at start go to those",
                len(self._urls),
                self._expected_replicas,
                self._startup_grace_s,
            )
            self._release_held()
            self._changed_view()

    def _release_held(self) -> None:
        held, self._held = self._held, {}
        for url, entry in held.items():
            self._entries[url] = entry
            self._log_moves(self._assignment.add_engine(url))

    async def close(self) -> None:
        tasks = [t for t in (self._monitor, self._release_timer, *self._checks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor = None

    # -- replicas ----------------------------------------------------------------------------------------

    async def register_replica(
        self, info: ReplicaInfo, handle: object, engines: Sequence[EngineEntry] = ()
    ) -> FleetView:
        """A replica that started (or restarted, or saw a new epoch), with the engines it holds now."""
        replica_id = info.replica_id
        if self._incarnations.get(replica_id, info.incarnation) != info.incarnation:
            self._depart(replica_id, "restarted")  # the old incarnation's engines go elsewhere first
        self._urls[replica_id] = self._previous_urls[replica_id] = info.url
        self._incarnations[replica_id] = info.incarnation
        self._links[replica_id] = self._link_factory(handle)
        self._handles[replica_id] = handle
        self._failures[replica_id] = 0
        for entry in engines:  # a new epoch: engines registered before the controller restarted
            if entry.url not in self._entries:
                self._held.pop(entry.url, None)
                self._entries[entry.url] = entry
                self._log_moves(self._assignment.add_engine(entry.url, prefer=replica_id))
        self._log_moves(self._assignment.add_replica(replica_id))
        if self._held and len(self._urls) >= self._expected_replicas:
            self._release_held()
        log.info("replica %s registered at %s", replica_id, info.url)
        return self._changed_view()

    async def deregister_replica(self, replica_id: str, incarnation: str) -> FleetView:
        """A replica that stops on purpose."""
        if self._incarnations.get(replica_id) == incarnation:
            self._depart(replica_id, "stopped")
            return self._changed_view()
        return self._view

    async def previous_url(self, replica_id: str) -> str | None:
        """Where the replica served last (a restarted one binds the same port where it can, so the session
        URLs agents hold still reach it)."""
        return self._previous_urls.get(replica_id)

    async def suspect(self, replica_id: str) -> None:
        """A replica could not reach `replica_id`: check it now rather than at the next round."""
        if replica_id in self._links:
            self._spawn_check(replica_id)

    # -- engines -----------------------------------------------------------------------------------------

    async def add_engine(self, entry: EngineEntry, wait_s: float = 30.0) -> EngineChange:
        """Register an engine with the fleet; once its owner has it, answer with the owner's description of
        it. An owner that cannot reach it says so, and the engine is dropped again (as one gateway does)."""
        if entry.url not in self._entries:  # else: registered already (an engine registering again)
            self._entries[entry.url] = entry
            self._log_moves(self._assignment.add_engine(entry.url))
            self._changed_view()
        view = self._view
        owner = self._assignment.owner(entry.url)
        if owner is None:
            return EngineChange(ok=True, view=view, url=entry.url, error="no replica is live to own it yet")
        try:
            joined = await self._links[owner].joined(entry.url, view.version, wait_s)
        except (ReplicaUnreachable, KeyError) as exc:  # KeyError: the owner left meanwhile
            return EngineChange(
                ok=True, view=self._view, url=entry.url, owner=owner, error=f"owner did not confirm: {exc}"
            )
        if joined.ok:
            return EngineChange(ok=True, view=self._view, url=entry.url, owner=owner, worker=joined.worker)
        if entry.url in self._entries:
            del self._entries[entry.url]
            self._log_moves(self._assignment.remove_engine(entry.url))
            self._changed_view()
        return EngineChange(
            ok=False,
            view=self._view,
            url=entry.url,
            owner=owner,
            error=joined.error,
            code="worker_unreachable",
        )

    async def owner_joined(self, url: str, wait_s: float) -> JoinResult:
        """Once engine `url`'s owner has applied the view of now: whether the engine joined its pool (its first
        attempt; bounded by `wait_s`). Leaves the engine registered whatever the answer, as a gateway keeps an
        engine it cannot reach yet."""
        owner = self._assignment.owner(url)
        if owner is None:
            return JoinResult(ok=False, error="no replica is live to own it yet")
        try:
            return await self._links[owner].joined(url, self._view.version, wait_s)
        except (ReplicaUnreachable, KeyError) as exc:  # KeyError: the owner left meanwhile
            return JoinResult(ok=False, error=f"owner did not confirm: {exc}")

    async def remove_engine(self, ref: str) -> EngineChange:
        """Unregister an engine, named by its URL or its fleet id (`engine_fleet_id`)."""
        url = self._find_engine(ref)
        if url is None:
            return EngineChange(
                ok=False, view=self._view, url=ref, error=f"no worker {ref!r}", code="worker_not_found"
            )
        owner = self._assignment.owner(url)
        del self._entries[url]
        self._log_moves(self._assignment.remove_engine(url))
        return EngineChange(ok=True, view=self._changed_view(), url=url, owner=owner)

    def _find_engine(self, ref: str) -> str | None:
        url = ref.rstrip("/")
        if url in self._entries:
            return url
        return next((u for u in self._entries if engine_fleet_id(u) == ref), None)

    # -- fleet-wide operations (fleet/operations.py) ------------------------------------------------------

    async def operate(self, name: str, body: dict[str, Any], query: dict[str, str]) -> Answer:
        """Run engine-control operation `name` on every live replica at once; the fleet's answer says which
        replicas and engines took part, and fails where an engine's owner did not (fleet/operations.py). An
        all-at-once weight update is run in its two steps (`_update_all_or_none`)."""
        operation = operation_named(name)
        view = self._view
        if name == "update_weights" and not body.get("staggered"):
            return await self._update_all_or_none(view, body, query)
        results = await self._on_replicas(view, view.replicas, name, body, query)
        return compose(operation, view, results, body)

    async def _on_replicas(
        self,
        view: FleetView,
        replica_ids: Iterable[str],
        name: str,
        body: dict[str, Any],
        query: dict[str, str],
    ) -> dict[str, ReplicaResult | str]:
        """Operation `name` on these replicas at once: each one's result, or why it gave none."""
        timeout_s = operation_named(name).timeout_s
        links = {r: self._links[r] for r in replica_ids if r in self._links}

        async def one(replica_id: str, link: ReplicaLink) -> ReplicaResult | str:
            try:
                return await link.operate(name, body, query, timeout_s)
            except ReplicaUnreachable as exc:
                self._spawn_check(replica_id)
                return str(exc)

        answers = await asyncio.gather(*(one(r, link) for r, link in links.items()))
        results = dict(zip(links, answers, strict=True))
        self._learn_versions(results)
        log.info(
            "fleet %s on %d replicas (view %d): %s",
            name,
            len(results),
            view.version,
            ", ".join(f"{r} {a if isinstance(a, str) else a.answer.status}" for r, a in results.items()),
        )
        return results

    def _learn_versions(self, results: Mapping[str, ReplicaResult | str]) -> None:
        """The engines' weight versions as their owners just reported them; a change reaches every replica in
        the next view (FleetView.weight_versions)."""
        known = dict(self._weight_versions)
        for result in results.values():
            if isinstance(result, ReplicaResult):
                known.update(result.versions)
        known = {url: label for url, label in known.items() if url in self._entries}
        if known != self._weight_versions:
            self._weight_versions = known
            self._changed_view()

    async def _update_all_or_none(
        self, view: FleetView, body: dict[str, Any], query: dict[str, str]
    ) -> Answer:
        """A weight update of the whole fleet against one membership snapshot (server/weight_update.py): every
        replica pauses and updates its engines and holds them; only when every replica has answered does any
        engine continue, each replica told whether an engine elsewhere failed (or went unreached), so that
        `exclude` and `rollback` hold for the fleet, not per replica. The engines taken out leave the
        membership too: no replica takes them back until the trainer registers them again."""
        begun = await self._on_replicas(view, view.replicas, UPDATE_BEGIN, body, query)
        began = {
            r: res for r, res in begun.items() if isinstance(res, ReplicaResult) and res.answer.status == 200
        }
        operation = operation_named("update_weights")
        if not began:  # refused everywhere (a bad body: the caller's error), or nobody answered
            return compose(operation, view, begun, body)
        failed = [engine for res in began.values() for engine in res.answer.json["failed"]]
        unreached = missing_engines(view, begun)
        failed_anywhere = len(began) < len(begun) or bool(failed) or bool(unreached)
        # an update no engine took leaves every engine on the same weights: nothing to exclude or roll back
        updated_anywhere = any(
            len(res.answer.engines) > len(res.answer.json["failed"]) for res in began.values()
        )
        verdict = {"failed_elsewhere": failed_anywhere, "updated_elsewhere": updated_anywhere}
        finished = await self._on_replicas(view, began, UPDATE_FINISH, verdict, query)
        answer = compose(operation, view, {**begun, **finished}, body)
        excluded: list[str] = []
        rolled_back: list[str] = []
        for result in finished.values():
            if isinstance(result, ReplicaResult) and isinstance(result.answer.json, dict):
                report = result.answer.json
                urls = {e["engine"]: e["url"] for e in report.get("engines", [])}
                excluded += [urls[e] for e in report.get("excluded", [])]
                rolled_back += [urls[e] for e in report.get("rolled_back", [])]
        for url in excluded:
            await self.remove_engine(url)
        log.warning(
            "fleet weight update: %s; excluded %s, rolled back %s",
            "every engine took it" if not failed_anywhere else "not every engine took it",
            excluded or "none",
            rolled_back or "none",
        )
        return Answer(
            answer.status,
            {**answer.json, "excluded": sorted(excluded), "rolled_back": sorted(rolled_back)},
            engines=answer.engines,
        )

    # -- the view ----------------------------------------------------------------------------------------

    async def view(self) -> FleetView:
        return self._view

    @property
    def latest(self) -> FleetView:
        """The view now (for code in the controller's own process)."""
        return self._view

    async def next_view(self, after_version: int, timeout_s: float = 10.0, epoch: str = "") -> FleetView:
        """The view once its version passes `after_version`, or the same one after `timeout_s`; at once for
        a caller whose view is of another `epoch` (this controller restarted since)."""
        if epoch == self.epoch and self._view.version <= after_version:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await changed.wait()
        return self._view

    def _snapshot(self) -> FleetView:
        return FleetView.of(
            self._assignment,
            epoch=self.epoch,
            version=self._version,
            urls=self._urls,
            engines=self._entries,
            incarnations=self._incarnations,
            handles=self._handles,
            weight_versions=self._weight_versions,
        )

    def _changed_view(self) -> FleetView:
        self._version += 1
        self._view = self._snapshot()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every long poll waiting on the old version
        return self._view

    def _log_moves(self, moves: list[Move]) -> None:
        self.moves += moves
        for move in moves:
            log.info("engine %s: %s -> %s", move.engine, move.source, move.target)

    # -- liveness ----------------------------------------------------------------------------------------

    def _depart(self, replica_id: str, why: str) -> None:
        if replica_id not in self._urls:
            return
        log.warning("replica %s left (%s): its engines go to the others", replica_id, why)
        self.departures.append((replica_id, why))
        del self._urls[replica_id]
        self._incarnations.pop(replica_id, None)
        self._links.pop(replica_id, None)
        self._handles.pop(replica_id, None)
        self._failures.pop(replica_id, None)
        self._log_moves(self._assignment.remove_replica(replica_id))

    async def _watch(self) -> None:
        while True:  # the controller's lifetime; one round per interval, each check bounded by its timeout
            await asyncio.sleep(self.ping_interval_s)
            for replica_id in list(self._links):
                self._spawn_check(replica_id)

    def _spawn_check(self, replica_id: str) -> None:
        task = asyncio.create_task(self._check(replica_id), name=f"ping-{replica_id}")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(self, replica_id: str) -> None:
        link, expected = self._links.get(replica_id), self._incarnations.get(replica_id)
        if link is None or expected is None:
            return
        try:
            incarnation = await link.ping(self.ping_timeout_s)
        except ReplicaUnreachable as exc:
            if self._incarnations.get(replica_id) != expected:
                return  # it registered again meanwhile: this answer is about the old incarnation
            self._failures[replica_id] = self._failures.get(replica_id, 0) + 1
            if exc.final or self._failures[replica_id] >= self.ping_failures:
                self._depart(replica_id, str(exc))
                self._changed_view()
            return
        if self._incarnations.get(replica_id) != expected:
            return
        if incarnation != expected:
            self._depart(replica_id, "restarted")
            self._changed_view()
        else:
            self._failures[replica_id] = 0
