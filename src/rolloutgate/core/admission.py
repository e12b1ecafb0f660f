"""Per-engine admission: request slots and the prefill token budget.

Theory of operation: the gateway sends an engine at most `capacity` requests at once (the engine's reported
`max_running_requests`, or configured), so a dispatch means "the engine starts now" and the engine's own queue
stays empty: time in a queue is gateway time, where no budget is charged. Optionally, at most
`prefill_token_budget` uncached prompt tokens may be in prefill on an engine at once, so that long-context
sessions do not freeze everyone else's decode (a prefill storm). A request is "in prefill" from its dispatch
until the engine reports its first progress.

The uncached estimate of a request on an engine is its prompt tokens minus what the engine is believed to hold
for its session (session_table.py): a session's next turn on the engine that ran its previous turn costs only
its new tokens.

Rules:
1. `can_admit(uncached)`: a free slot, and the prompt fits the budget, or nothing else is in prefill there (a
   prompt larger than the whole budget still runs, alone, and never starves).
2. Every `admit` is matched by exactly one `release`; `finish_prefill` at most once in between.
3. In wallclock mode the gateway builds slots with capacity and budget math.inf: no admission at all.
"""

from __future__ import annotations

import math

__all__ = ("EngineSlots",)


class EngineSlots:
    """Counts of one engine's requests in flight and uncached prompt tokens in prefill."""

    __slots__ = ("capacity", "in_flight", "prefill_token_budget", "prefill_tokens")

    def __init__(self, *, capacity: float, prefill_token_budget: float = math.inf) -> None:
        self.capacity = capacity
        self.prefill_token_budget = prefill_token_budget
        self.in_flight = 0
        self.prefill_tokens = 0

    def has_room(self) -> bool:
        """A free slot (the prefill budget aside)."""
        return self.in_flight < self.capacity

    def can_admit(self, uncached_tokens: int) -> bool:
        """A free slot, and `uncached_tokens` fit the prefill budget (or no other prefill is in progress)."""
        if self.in_flight >= self.capacity:
            return False
        return self.prefill_tokens == 0 or self.prefill_tokens + uncached_tokens <= self.prefill_token_budget

    def admit(self, uncached_tokens: int) -> None:
        self.in_flight += 1
        self.prefill_tokens += uncached_tokens

    def finish_prefill(self, uncached_tokens: int) -> None:
        self.prefill_tokens -= uncached_tokens

    def release(self, uncached_in_prefill: int) -> None:
        """A request left the engine; `uncached_in_prefill` is its prompt if it was still in prefill, else 0."""
        if self.in_flight <= 0:
            raise ValueError("release without a request in flight")
        self.in_flight -= 1
        self.prefill_tokens -= uncached_in_prefill

    def __repr__(self) -> str:
        return f"<EngineSlots [{self.in_flight}/{self.capacity} in flight, {self.prefill_tokens} prefill tokens]>"
