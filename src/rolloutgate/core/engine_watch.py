"""Engine-level progress for calls the engine does not stream to the gateway.

Theory of operation
-------------------
A non-streaming client's call is sent so that the engine does no more output work than for the same call
sent directly (engines/base.py): the gateway sees its first token at most (SGLang `/generate`) and then
nothing until the whole answer. Its liveness comes from the engine instead. While an engine has such calls,
the edge reads the engine's generated-token counter every poll (server/engine_watch.py) and tells this
tracker how many tokens the engine generated since the last reading; each reading with tokens is
engine-level progress (`ProgressReported(engine_level=True)`) for the watched calls on that engine.

Each watched call is credited an even share of those tokens (tokens / requests the engine holds, at least
the watched ones). While a call's credit stays within what it may generate (`credit_limit`), every reading
with tokens reports progress for it. A call credited with more than twice its `max_new_tokens` (plus a
margin for its prefill) has had time to finish twice over: it gets no more progress, so the core's
stuck-alone rule catches it `stall_timeout` of charged time later while the engine keeps progressing for
others (core/verdicts.py `_judge`). A frozen engine shows no tokens: none of its calls gets progress, and the
engine's liveness catches it `stall_timeout` (+ its pause check) after the last reading that showed tokens,
so at most one poll interval later than per-token watching would (core/liveness.py).

Rules:
1. A call without a token limit is credited without bound: only its timeout and its engine's liveness
   watch it.
2. Readings are per engine and hold no request state; a call re-dispatched elsewhere is re-added (its
   credit starts again at zero).
"""

from __future__ import annotations

import math

from rolloutgate.core.events import ProgressReported

__all__ = ("CREDIT_MARGIN_TOKENS", "EngineWatch", "credit_limit")

CREDIT_MARGIN_TOKENS = 1024  # covers the share credited while the call's own prefill ran


def credit_limit(max_new_tokens: int | None) -> float:
    """The credit past which a watched call counts as not progressing (module docstring)."""
    if max_new_tokens is None:
        return math.inf
    return 2.0 * max_new_tokens + CREDIT_MARGIN_TOKENS


class _Watched:
    __slots__ = ("attempt", "credited", "limit")

    def __init__(self, attempt: int, limit: float) -> None:
        self.attempt = attempt
        self.limit = limit
        self.credited = 0.0


class EngineWatch:
    """The watched calls per engine and their credit; see the module docstring."""

    __slots__ = ("_engines", "_where")

    def __init__(self) -> None:
        self._engines: dict[str, dict[str, _Watched]] = {}
        self._where: dict[str, str] = {}  # request id -> engine id

    def add(self, engine_id: str, request_id: str, attempt: int, max_new_tokens: int | None) -> bool:
        """Watch a call's attempt on an engine (replacing any earlier attempt). True if the engine had no
        watched call before (the edge starts polling it)."""
        self.remove(request_id)
        calls = self._engines.get(engine_id)
        started = calls is None
        if calls is None:
            calls = self._engines[engine_id] = {}
        calls[request_id] = _Watched(attempt, credit_limit(max_new_tokens))
        self._where[request_id] = engine_id
        return started

    def remove(self, request_id: str) -> None:
        engine_id = self._where.pop(request_id, None)
        if engine_id is None:
            return
        calls = self._engines[engine_id]
        del calls[request_id]
        if not calls:
            del self._engines[engine_id]

    def is_watching(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def watched(self, engine_id: str) -> int:
        return len(self._engines.get(engine_id, ()))

    def observe(
        self, engine_id: str, generated_tokens: float, engine_requests: int
    ) -> list[ProgressReported]:
        """The engine generated `generated_tokens` since its last reading, holding `engine_requests` requests
        (running and waiting, as it reports them): the engine-level progress events to hand the core."""
        calls = self._engines.get(engine_id)
        if not calls or not generated_tokens > 0:
            return []
        share = generated_tokens / max(engine_requests, len(calls))
        out: list[ProgressReported] = []
        for request_id, call in calls.items():
            if call.credited > call.limit:
                continue
            call.credited += share
            out.append(
                ProgressReported(request_id=request_id, tokens=0, attempt=call.attempt, engine_level=True)
            )
        return out

    def __repr__(self) -> str:
        return f"<EngineWatch {sum(len(c) for c in self._engines.values())} calls on {len(self._engines)} engines>"
