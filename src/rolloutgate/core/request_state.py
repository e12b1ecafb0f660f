"""The request lifecycle: one enum and its transition table.

Theory of operation: a request moves RECEIVED -> QUEUED -> DISPATCHED -> STREAMING -> DONE, and may go back
from DISPATCHED or STREAMING to QUEUED when the gateway re-dispatches it (a hung engine, a refused connection,
the gate closing in abort mode). "First token" in DESIGN.md is the DISPATCHED -> STREAMING transition: the first
progress the engine reports ends the request's prefill. The four end states are terminal.

Rules:
1. Every change of a request's state goes through `transition()`, which consults `TRANSITIONS`; an illegal
   change raises `InvalidTransition` and the state stays as it was. State never changes silently.
2. "Paused" is not a state: it is orthogonal (the gate or the request's engine is paused) and lives in the
   request's clock (request_clock.py).
"""

from __future__ import annotations

import enum

__all__ = ("TERMINAL_STATES", "TRANSITIONS", "InvalidTransition", "RequestState", "transition")


class InvalidTransition(Exception):
    """A state machine was asked for a change its transition table does not allow."""

    def __init__(self, machine: str, current: enum.Enum, wanted: enum.Enum) -> None:
        super().__init__(f"{machine}: illegal transition {current.name} -> {wanted.name}")
        self.current = current
        self.wanted = wanted


class RequestState(enum.Enum):
    RECEIVED = "received"  # accepted by the front, not yet placed
    QUEUED = "queued"  # waiting in the gateway for an engine slot (no timeout runs)
    DISPATCHED = "dispatched"  # sent to an engine, which started it; in prefill until the first progress
    STREAMING = "streaming"  # the engine reported progress: prefill is over
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"  # the client left and no retry attached: forgotten without an answer

    # Members are singletons compared by identity, so identity hashing is consistent with equality; Enum's
    # own __hash__ is a Python-level call (hash of the name), paid twice on every state change (the table).
    __hash__ = object.__hash__


_ENDS = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.TIMED_OUT, RequestState.CANCELLED})
TERMINAL_STATES = _ENDS

TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.RECEIVED: frozenset({RequestState.QUEUED, RequestState.FAILED}),
    RequestState.QUEUED: frozenset({RequestState.DISPATCHED}) | _ENDS - {RequestState.DONE},
    RequestState.DISPATCHED: frozenset({RequestState.STREAMING, RequestState.QUEUED}) | _ENDS,
    RequestState.STREAMING: frozenset({RequestState.QUEUED}) | _ENDS,
    RequestState.DONE: frozenset(),
    RequestState.FAILED: frozenset(),
    RequestState.TIMED_OUT: frozenset(),
    RequestState.CANCELLED: frozenset(),
}


def transition(current: RequestState, wanted: RequestState) -> RequestState:
    """Return `wanted` if the table allows `current -> wanted`; raise `InvalidTransition` otherwise."""
    if wanted not in TRANSITIONS[current]:
        raise InvalidTransition("request", current, wanted)
    return wanted
