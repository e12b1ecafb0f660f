"""The placement interface: which engine a request should run on, now.

Theory of operation: a policy is a pure function of the request and a read-only view of the schedulable engines
(healthy and not paused; the gateway filters). `choose` returns the engine the request should run on, or None:
nothing suitable can take it now. An engine that can admit the request now (a free slot and room in its
prefill budget, `EngineView.can_admit`) gets it at once; an engine that cannot admit it now (prefill_aware: its
budget must drain first; consistent_hash: the key's engine, full) gets it as soon as it can: the gateway parks
it in that engine's lane. On None the gateway parks the request on its pinned engine, on its affine engine when the policy
is affinity-aware and that engine is schedulable, or else it stays at the head of the shared lane (see
dispatcher.py).

Rules:
1. Policies never mutate anything and never use randomness unless injected (`random.Random`).
2. `pinned_engine` requests go only there (`choose_pinned`).
3. `avoid_engines` (where the request just failed, hung or got stuck) are used only when no other engine is
   schedulable at all (`eligible`).
4. Ties between equally loaded engines break on outstanding prompt tokens, then on engine order (join order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

__all__ = ("EngineView", "PlacementPolicy", "PlacementRequest", "choose_pinned", "eligible", "least_loaded")


@dataclass(slots=True, kw_only=True)  # not frozen: built per request (core/events.py, `_per_request`)
class PlacementRequest:
    """What placement needs to know about one request."""

    request_id: str
    prompt_tokens: int
    pinned_engine: str | None = None
    affine_engine: str | None = None  # where its session's prefix is cached, if known (and not avoided)
    affine_cached_tokens: int = 0
    avoid_engines: frozenset[str] = frozenset()
    is_new_session: bool = False  # it has a routing key the session table does not know (cache_warm.py)
    routing_key: str | None = None  # its session's key (consistent_hash.py hashes it)

    def uncached_on(self, engine_id: str) -> int:
        """Prompt tokens `engine_id` would have to prefill."""
        if engine_id == self.affine_engine:
            return max(0, self.prompt_tokens - self.affine_cached_tokens)
        return self.prompt_tokens


class EngineView(Protocol):
    """A read-only view of one schedulable engine."""

    @property
    def engine_id(self) -> str: ...

    @property
    def order(self) -> int: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def outstanding_tokens(self) -> int:
        """Uncached prompt tokens dispatched there and still in prefill."""
        ...

    @property
    def decoding(self) -> int:
        """Requests past their prefill there (the decodes a new prefill would slow)."""
        ...

    @property
    def decode_weight(self) -> int:
        """The decodes there, each counted once plus once per long prefill it has already sat through there:
        how much a new long prefill there would add to the tail (placement/prefill_aware.py)."""
        ...

    @property
    def backlog_tokens(self) -> int:
        """Prefill a request sent there now would wait behind, in uncached prompt tokens: those in prefill,
        those of requests waiting in the gateway for this engine, and the engine's rest (admission.py)."""
        ...

    @property
    def active_sessions(self) -> int:
        """Sessions bound to this engine (session_table.py `sessions_on`)."""
        ...

    @property
    def session_tokens(self) -> int:
        """Prefix tokens those sessions are believed to hold in its cache (`tokens_on`)."""
        ...

    def has_room(self) -> bool:
        """A free request slot (the prefill budget aside)."""
        ...

    def can_admit(self, request: PlacementRequest) -> bool:
        """A free slot, and room for the request's uncached prompt in the prefill budget."""
        ...


class PlacementPolicy(Protocol):
    name: ClassVar[str]

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        """An engine id that can admit `request` now, or None."""
        ...


E = TypeVar("E", bound=EngineView)


def eligible(request: PlacementRequest, engines: Sequence[E]) -> Sequence[E]:
    """The engines the request may use: all but the avoided ones, unless only avoided ones exist."""
    avoid = request.avoid_engines
    if not avoid:
        return engines
    others = [e for e in engines if e.engine_id not in avoid]
    return others if others else engines


def choose_pinned(request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
    """For a pinned request: its engine if schedulable and able to admit it now, else None."""
    for engine in engines:
        if engine.engine_id == request.pinned_engine:
            return engine.engine_id if engine.can_admit(request) else None
    return None


def least_loaded(request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
    """Least outstanding work among the engines that can admit the request now."""
    best: EngineView | None = None
    for engine in engines:
        if not engine.can_admit(request):
            continue
        if best is None or (engine.in_flight, engine.outstanding_tokens, engine.order) < (
            best.in_flight,
            best.outstanding_tokens,
            best.order,
        ):
            best = engine
    return None if best is None else best.engine_id
