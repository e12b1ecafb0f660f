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
- the policy names an engine that cannot admit it now (prefill_aware: the cheapest engine's budget must drain
  first, placement/prefill_aware.py) -> park it in that engine's lane, weighted by the uncached tokens it will
  cost there (the lane weights are part of the engine's backlog that placement reads); the next shared request
  becomes the head;
- shared head, nothing fits now, and it has a target (pinned engine; affine engine under an affinity policy)
  -> park it in that engine's lane; the next shared request becomes the head;
- shared head, nothing fits and no target -> the shared lane is blocked for this pump (FIFO). If an engine had a
  slot but no room in its prefill budget, the engine whose budgeted prefills drain first is *reserved* for this
  head: it takes no other budgeted work in this pump (prefills exempt from the budget still go, see
  admission.py), so its prefills drain and the large prompt runs next (no starvation). It is the same engine
  pump after pump: a reserved engine's budgeted tokens only shrink;
- an engine lane head that does not fit its engine's prefill budget: if it waits there by choice (not pinned)
  and the policy now prefers another engine that can admit it at once, it goes there (late binding: a prompt
  parked for one engine takes whichever frees first when that is cheaper); otherwise it reserves its engine
  likewise.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from rolloutgate.core.placement import EngineView, PlacementPolicy, PlacementRequest, is_within_bound
from rolloutgate.core.placement.base import eligible
from rolloutgate.core.records import EngineRecord, RequestRecord
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
        """The placement view of a request, with its session's engine (else its group's) unless avoided."""
        affine, cached = None, 0
        sessions = self._sessions
        entry = sessions.get(r.routing_key, r.group)
        if entry is not None and entry[0] not in r.avoid_engines:
            affine, cached = entry
        return PlacementRequest(
            request_id=r.request_id,
            prompt_tokens=r.prompt_tokens,
            pinned_engine=r.pinned_engine,
            affine_engine=affine,
            affine_cached_tokens=cached,
            avoid_engines=r.avoid_engines,
            is_new_session=sessions.is_new_session(r.routing_key),
            routing_key=r.routing_key,
        )

    def place_arrival(self, r: RequestRecord, schedulable: Sequence[EngineRecord]) -> EngineRecord | None:
        """Where `r`, arriving at an empty queue, starts now: the first decision `decisions` makes with `r`
        queued alone (nothing reserved, no engine lanes), without queueing it. None: anything else (no free
        slot, no choice, a budget to wait for); queue it and let `decisions` decide, as it would have anyway
        (placement policies are pure, so nothing here changed what it will see)."""
        schedulable = _allowed(r, schedulable)
        if not any(e.has_room() for e in schedulable):
            return None  # `decisions`: no engine with a free slot (its version policy allows)
        placement = self.placement_request(r)
        choice = self._policy.choose(placement, schedulable)
        if choice is None:
            return None
        for engine in schedulable:
            if engine.engine_id == choice:
                return engine if engine.can_admit(placement) else None
        return None

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
            least = _least_in_flight(schedulable, reserved)
            if least < 0:
                return  # no engine has a free slot
            best = self._best_candidate(requests, engines, reserved, skipped, least, is_shared_blocked)
            if best is None:
                return
            best_id, best_lane, best_kind = best
            r = requests[best_id]
            if best_kind == _OWN:
                assert best_lane is not None
                engine = engines[best_lane[0]]
                uncached = self._sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id, r.group)
                if engine.slots.can_admit(uncached) and (
                    engine.engine_id not in reserved or engine.slots.is_exempt(uncached)
                ):
                    queue.remove(best_id)
                    yield r, engine
                    continue
                if not best_lane[1]:  # waiting for this engine's budget: another may take it now instead
                    elsewhere = self._elsewhere_now(r, engine, engines, schedulable, reserved)
                    if elsewhere is not None:
                        queue.remove(best_id)
                        yield r, elsewhere
                        continue
                reserved.add(engine.engine_id)
                continue
            placement = self.placement_request(r)
            views = _views(_allowed(r, schedulable), reserved)
            choice = self._policy.choose(placement, views)
            if choice is not None:
                view = next(v for v in views if v.engine_id == choice)
                if view.can_admit(placement):
                    queue.remove(best_id)
                    yield r, engines[choice]
                    continue
                lane: Lane = (choice, False)  # the policy would rather wait for this engine's budget
                if lane != best_lane:
                    queue.move(best_id, lane, placement.uncached_on(choice))
                    continue
            if best_kind == _MOVE:
                skipped.add(best_lane)
                continue
            target = self._target_lane(r, placement, engines) or _lane_within_policy(r, schedulable)
            if target is not None:
                queue.move(best_id, target, placement.uncached_on(target[0]))
                continue
            is_shared_blocked = True
            waiting_for_budget = [  # a slot, but no room in the budget
                engines[e.engine_id]
                for e in eligible(placement, views)
                if e.has_room() and e.engine_id not in reserved
            ]
            if waiting_for_budget:
                reserved.add(min(waiting_for_budget, key=_drains_first).engine_id)

    def _elsewhere_now(
        self,
        r: RequestRecord,
        engine: EngineRecord,
        engines: Mapping[str, EngineRecord],
        schedulable: Sequence[EngineRecord],
        reserved: set[str],
    ) -> EngineRecord | None:
        """Late binding: the engine the policy now prefers for a request waiting for `engine`'s budget, if it
        is another one that can admit the request at once (None: keep waiting)."""
        queue = self._queue
        lane = queue.lane_of(r.request_id)
        weight = queue.weight_of(r.request_id)
        queue.move(r.request_id, SHARED)  # not part of the backlog it is weighing
        placement = self.placement_request(r)
        views = _views(_allowed(r, schedulable), reserved)
        choice = self._policy.choose(placement, views)
        if choice is not None and choice != engine.engine_id:
            view = next(v for v in views if v.engine_id == choice)
            if view.can_admit(placement):
                return engines[choice]
        queue.move(r.request_id, lane, weight)
        return None

    def _best_candidate(
        self,
        requests: Mapping[str, RequestRecord],
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
            if lane in skipped:
                continue
            engine = engines.get(engine_id)
            head = queue.peek(lane)
            if head is None:  # pragma: no cover - engine_lanes lists non-empty lanes only
                continue
            if engine is not None and not requests[head[1]].allows_weights_of(engine):
                kind = _MOVE  # its policy forbids the weights there now (not pinned: pinned ones allow any)
            elif engine_id in reserved:
                if engine is None or not engine.has_room() or not self._is_exempt(requests[head[1]], engine):
                    continue  # a reserved engine takes only prefills exempt from the budget
                kind = _OWN
            elif engine is not None and engine.is_schedulable and engine.has_room():
                kind = _OWN
            elif not is_pinned and (
                engine is None
                or not engine.is_schedulable
                or not is_within_bound(engine.in_flight, least, self._max_excess)
            ):
                kind = _MOVE  # its engine is gone, unschedulable or overloaded: the session moves
            else:
                continue
            if best_key is None or head[0] < best_key:
                best_key, best_id = head
                best_lane, best_kind = lane, kind
        return None if best_key is None else (best_id, best_lane, best_kind)

    def _is_exempt(self, r: RequestRecord, engine: EngineRecord) -> bool:
        uncached = self._sessions.uncached(r.routing_key, r.prompt_tokens, engine.engine_id, r.group)
        return engine.slots.is_exempt(uncached)

    def _target_lane(
        self, r: RequestRecord, placement: PlacementRequest, engines: Mapping[str, EngineRecord]
    ) -> Lane:
        if placement.pinned_engine is not None:
            return (placement.pinned_engine, True)
        affine = placement.affine_engine
        if self._is_affine and affine is not None:
            engine = engines.get(affine)
            if engine is not None and engine.is_schedulable and r.allows_weights_of(engine):
                return (affine, False)
        return None

    def __repr__(self) -> str:
        return f"<Dispatcher {self._policy.name} [{len(self._queue)} waiting]>"


def _allowed(r: RequestRecord, schedulable: Sequence[EngineRecord]) -> Sequence[EngineRecord]:
    """The engines whose weights the request's version policy allows (RequestRecord.allows_weights_of)."""
    if r.max_version_lag is None or r.pinned_engine is not None:
        return schedulable
    return [e for e in schedulable if r.allows_weights_of(e)]


def _lane_within_policy(r: RequestRecord, schedulable: Sequence[EngineRecord]) -> Lane:
    """For a shared head its version policy kept off engines with room: the lane of the least loaded engine
    it allows, so that it waits there and what follows it may take the engines it refused (no head-of-line
    block on weights that are not its); None when nothing was refused or nothing is allowed."""
    allowed = _allowed(r, schedulable)
    if len(allowed) == len(schedulable) or not allowed:
        return None
    if not any(e.has_room() for e in schedulable if not r.allows_weights_of(e)):
        return None  # the engines it refused are full too: it blocks the shared lane as any head does
    return (min(allowed, key=lambda e: (e.in_flight, e.order)).engine_id, False)


def _views(schedulable: Sequence[EngineRecord], reserved: set[str]) -> Sequence[EngineView]:
    """The engines as placement sees them: reserved ones admit only prefills exempt from the budget."""
    if not reserved:
        return schedulable
    return [_ReservedView(e) if e.engine_id in reserved else e for e in schedulable]


def _least_in_flight(schedulable: Sequence[EngineRecord], reserved: set[str]) -> int:
    """Fewest requests in flight among the engines with a free slot, unreserved ones first; -1 if none."""
    least = min(
        (e.in_flight for e in schedulable if e.engine_id not in reserved and e.has_room()), default=-1
    )
    if least < 0 and reserved:
        least = min((e.in_flight for e in schedulable if e.has_room()), default=-1)
    return least


def _drains_first(engine: EngineRecord) -> tuple[int, int, int]:
    """Reservation order: the engine whose budgeted prefills end soonest (least of them), then least loaded.

    A reserved engine takes no new budgeted work, so its budgeted tokens only shrink while the others' may
    grow: the same engine stays the choice pump after pump until the blocked request fits there.
    """
    return (engine.slots.budget_tokens, engine.in_flight, engine.order)


class _ReservedView:
    """A reserved engine as placement sees it for the rest of a pump: it admits only exempt prefills."""

    __slots__ = ("_engine",)

    def __init__(self, engine: EngineRecord) -> None:
        self._engine = engine

    @property
    def engine_id(self) -> str:
        return self._engine.engine_id

    @property
    def order(self) -> int:
        return self._engine.order

    @property
    def in_flight(self) -> int:
        return self._engine.in_flight

    @property
    def outstanding_tokens(self) -> int:
        return self._engine.outstanding_tokens

    @property
    def decoding(self) -> int:
        return self._engine.decoding

    @property
    def decode_weight(self) -> int:
        return self._engine.decode_weight

    @property
    def backlog_tokens(self) -> int:
        return self._engine.backlog_tokens

    @property
    def active_sessions(self) -> int:
        return self._engine.active_sessions

    @property
    def session_tokens(self) -> int:
        return self._engine.session_tokens

    def has_room(self) -> bool:
        return self._engine.has_room()

    def can_admit(self, request: PlacementRequest) -> bool:
        slots = self._engine.slots
        return slots.has_room() and slots.is_exempt(request.uncached_on(self.engine_id))
