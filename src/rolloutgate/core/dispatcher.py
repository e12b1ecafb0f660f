"""Dispatch decisions: which waiting request runs next, and where.

Theory of operation
-------------------
`Dispatcher.decisions()` is a generator of (request, engine) pairs. The gateway applies each decision (which
changes the engine's load) before asking for the next, so every decision sees the current state, and the loop
ends when nothing more can start. It is the pure decision half of the gateway's pump; the gateway does the
bookkeeping and emits the `Dispatch` commands.

Each round looks at a bounded set of candidates, never at the whole queue:

- the head of the shared lane (placed by the policy anywhere it fits);
- for every engine with a free slot, the heads of its pinned and affine lanes (they run there);
- for every engine with waiting sessions that is full and over the load bound (session_affinity.is_within_bound)
  relative to the least loaded engine with room, or that is no longer schedulable, the head of its affine lane
  (the session moves, placed by the policy).

The candidate with the smallest sort key (tier, priority, arrival) goes first, so order is FIFO within a
priority across lanes as far as placement allows. A round costs O(E + log n) for E engines and n waiting
requests; each round dispatches, parks or blocks something, so a pump is O((E + log n) x decisions).

Outcomes per candidate:
- it fits -> yield it (dispatch);
- shared head, nothing fits now, and it has a target (pinned engine; affine engine under an affinity policy)
  -> park it in that engine's lane; the next shared request becomes the head;
- shared head, nothing fits and no target -> the shared lane is blocked for this pump (FIFO). If an engine had a
  slot but no room in its prefill budget, the least loaded such engine is *reserved* for this head: it takes no
  other work in this pump, so its prefills drain and the large prompt runs next (no starvation);
- an engine lane head that does not fit its engine's prefill budget reserves that engine likewise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from rolloutgate.core.engine_record import EngineRecord
from rolloutgate.core.placement import PlacementPolicy, PlacementRequest, is_within_bound
from rolloutgate.core.placement.base import eligible
from rolloutgate.core.request_record import RequestRecord
from rolloutgate.core.session_table import SessionTable
from rolloutgate.core.wait_queue import SHARED, Lane, WaitQueue

__all__ = ("Dispatcher",)

_SHARED, _OWN, _MOVE = 0, 1, 2


class Dispatcher:
    __slots__ = ("_is_affine", "_max_excess", "_policy", "_queue", "_sessions")

    def __init__(
        self,
        *,
        queue: WaitQueue,
        policy: PlacementPolicy,
        sessions: SessionTable,
        is_affine: bool,
        max_excess: int,
    ) -> None:
        self._queue = queue
        self._policy = policy
        self._sessions = sessions
        self._is_affine = is_affine
        self._max_excess = max_excess

    def placement_request(self, r: RequestRecord) -> PlacementRequest:
        """The placement view of a request, with its session's engine unless that engine is avoided."""
        affine, cached = None, 0
        entry = self._sessions.get(r.routing_key)
        if entry is not None and entry[0] not in r.avoid_engines:
            affine, cached = entry
        return PlacementRequest(
            request_id=r.request_id,
            prompt_tokens=r.prompt_tokens,
            pinned_engine=r.pinned_engine,
            affine_engine=affine,
            affine_cached_tokens=cached,
            avoid_engines=r.avoid_engines,
        )

    def decisions(
        self,
        requests: Mapping[str, RequestRecord],
        engines: Mapping[str, EngineRecord],
        schedulable: Sequence[EngineRecord],
    ) -> Iterator[tuple[RequestRecord, EngineRecord]]:
        """Yield (request, engine) pairs to dispatch, one at a time; see the module docstring."""
        queue = self._queue
        reserved: set[str] = set()
        skipped: set[Lane] = set()
        is_shared_blocked = False
        while len(queue):
            views = [e for e in schedulable if e.engine_id not in reserved] if reserved else schedulable
            least = min(
                (e.slots.in_flight for e in views if e.slots.in_flight < e.slots.capacity), default=-1
            )
            if least < 0:
                return  # no engine has a free slot
            best = self._best_candidate(engines, reserved, skipped, least, is_shared_blocked)
            if best is None:
                return
            best_id, best_lane, best_kind = best
            r = requests[best_id]
            if best_kind == _OWN:
                assert best_lane is not None
                engine = engines[best_lane[0]]
                uncached = self._sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id)
                if engine.slots.can_admit(uncached):
                    queue.remove(best_id)
                    yield r, engine
                else:
                    reserved.add(engine.engine_id)
                continue
            placement = self.placement_request(r)
            choice = self._policy.choose(placement, views)
            if choice is not None:
                queue.remove(best_id)
                yield r, engines[choice]
                continue
            if best_kind == _MOVE:
                skipped.add(best_lane)
                continue
            target = self._target_lane(placement, engines)
            if target is not None:
                queue.move(best_id, target)
                continue
            is_shared_blocked = True
            waiting_for_budget = [e for e in eligible(placement, views) if e.has_room()]  # a slot, no budget
            if waiting_for_budget:
                reserved.add(min(waiting_for_budget, key=lambda e: (e.in_flight, e.order)).engine_id)

    def _best_candidate(
        self,
        engines: Mapping[str, EngineRecord],
        reserved: set[str],
        skipped: set[Lane],
        least: int,
        is_shared_blocked: bool,
    ) -> tuple[str, Lane, int] | None:
        """The lane head with the smallest sort key among those that may start now: (request id, lane, kind)."""
        queue = self._queue
        best_key, best_id, best_lane, best_kind = None, "", SHARED, _SHARED
        if not is_shared_blocked and (head := queue.peek(SHARED)) is not None:
            best_key, best_id = head
        for lane in queue.engine_lanes():
            engine_id, is_pinned = lane
            if engine_id in reserved or lane in skipped:
                continue
            engine = engines.get(engine_id)
            if engine is not None and engine.is_schedulable and engine.has_room():
                kind = _OWN
            elif not is_pinned and (
                engine is None
                or not engine.is_schedulable
                or not is_within_bound(engine.in_flight, least, self._max_excess)
            ):
                kind = _MOVE  # its engine is gone, unschedulable or overloaded: the session moves
            else:
                continue
            head = queue.peek(lane)
            if head is not None and (best_key is None or head[0] < best_key):
                best_key, best_id = head
                best_lane, best_kind = lane, kind
        return None if best_key is None else (best_id, best_lane, best_kind)

    def _target_lane(self, placement: PlacementRequest, engines: Mapping[str, EngineRecord]) -> Lane:
        if placement.pinned_engine is not None:
            return (placement.pinned_engine, True)
        affine = placement.affine_engine
        if self._is_affine and affine is not None:
            engine = engines.get(affine)
            if engine is not None and engine.is_schedulable:
                return (affine, False)
        return None

    def __repr__(self) -> str:
        return f"<Dispatcher {self._policy.name} [{len(self._queue)} waiting]>"
