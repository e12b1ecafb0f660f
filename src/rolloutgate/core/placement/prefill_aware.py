"""Prefill-aware placement: weigh the prefill a request would cost on each engine against the decodes it slows.

Theory of operation
-------------------
With prefill-first scheduling (SGLang's default, reference/engines.md B.2-B.4) an engine's running decodes get
(almost) nothing while it prefills a prompt, and prompts are prefilled one after the other in arrival order. So
placing a request with `u` uncached prompt tokens on an engine with a backlog of `b` prefill tokens ahead of it
and `d` requests decoding costs, in prefill-token units (time = tokens / the engine's prefill rate):

    cost = b + u          the request's own wait for its first token (the prefills ahead of it, then its own)
         + w * u          every decode on the engine is held while its prompt is prefilled

`w` (EngineView.decode_weight) counts each of the `d` decodes there once, plus once for every long prefill it
has already sat through on that engine. A decode that has been held through several prefills is the one the
turn-latency tail is made of (a long decode sees every long prefill its engine runs while it lives): the next
one goes, other things equal, where the decodes have been held least so far. Measured in the exact world
(docs/prefill.md): with decodes counted equally, p99 turn latency did not move against admission off; with
this weight it fell by 1-2% (paired bootstrap intervals below zero on two sets of 40 seeds).

`u` comes from the session table: a session's next turn on the engine that holds its prefix costs only its new
tokens; anywhere else it costs the whole prompt (PlacementRequest.uncached_on). `b` is the engine's backlog
(EngineView.backlog_tokens): the uncached tokens in prefill there, those of requests already waiting in the
gateway for it, and its rest after a storm of long prefills (admission.py).

The request goes to the cheapest engine with a free slot; ties break on requests in flight, then prefill
tokens, then engine order, so short or fully cached prompts (u ~ 0) are spread by least outstanding work as
before. The cheapest engine may have no room in its prefill budget right now: its backlog is then part of the
cost, and the gateway parks the request for it (dispatcher.py) rather than freeze more decodes elsewhere; if
another engine becomes the cheaper choice and can take it at once before that, it goes there instead.

What falls out of the formula:
- a session stays on its engine when that is cheap (its new tokens there against its whole history elsewhere),
  and moves only when the prefill queued there outweighs a cold prefill elsewhere;
- a long cold prompt goes where the fewest decodes suffer and the least prefill is queued, and with the budget
  (one long prefill at a time per engine) long cold prefills spread instead of stacking on one engine;
- a session whose engine is the cheapest (ties included) but full waits for a slot there within the load bound
  of session affinity (`is_within_bound`), beyond which it moves as it would there.

Rules:
1. Pure: no mutation, no randomness; O(E) per decision for E schedulable engines.
2. Pinned requests go only to their engine, and only when it can admit them (`choose_pinned`); avoided
   engines are used only as a last resort (`eligible`).
3. `choose` returns an engine with a free slot, or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rolloutgate.core.placement.base import EngineView, PlacementRequest, choose_pinned, eligible
from rolloutgate.core.placement.session_affinity import is_within_bound

__all__ = ("PrefillAware", "prefill_cost")


def prefill_cost(request: PlacementRequest, engine: EngineView) -> int:
    """The request's prefill cost on `engine`, in prefill tokens (see the module docstring)."""
    uncached = request.uncached_on(engine.engine_id)
    return engine.backlog_tokens + uncached * (1 + engine.decode_weight)


class PrefillAware:
    name: ClassVar[str] = "prefill_aware"

    __slots__ = ("max_excess",)

    def __init__(self, max_excess: int = 8) -> None:
        if max_excess < 0:
            raise ValueError("max_excess must be >= 0")
        self.max_excess = max_excess

    def choose(self, request: PlacementRequest, engines: Sequence[EngineView]) -> str | None:
        if request.pinned_engine is not None:
            return choose_pinned(request, engines)
        candidates = eligible(request, engines)
        best: EngineView | None = None
        best_key: tuple[int, int, int, int] | None = None
        affine: EngineView | None = None
        for engine in candidates:
            if engine.engine_id == request.affine_engine:
                affine = engine
            if not engine.has_room():
                continue
            key = (prefill_cost(request, engine), engine.in_flight, engine.outstanding_tokens, engine.order)
            if best_key is None or key < best_key:
                best, best_key = engine, key
        if affine is not None and affine is not best:
            is_cheapest = best_key is None or prefill_cost(request, affine) <= best_key[0]
            least = min(e.in_flight for e in candidates)
            if is_cheapest and (
                affine.has_room() or is_within_bound(affine.in_flight, least, self.max_excess)
            ):
                return affine.engine_id if affine.has_room() else None  # None: wait for a slot there
        return None if best is None else best.engine_id

    def __repr__(self) -> str:
        return f"<PrefillAware max_excess={self.max_excess}>"
