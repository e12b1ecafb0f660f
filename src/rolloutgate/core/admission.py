"""Per-engine admission: request slots, the prefill token budget and the rest after a prefill.

Theory of operation
-------------------
The gateway sends an engine at most `capacity` requests at once (the engine's reported `max_running_requests`,
or configured), so a dispatch means "the engine starts now" and the engine's own queue stays empty: time in a
queue is gateway time, where no budget is charged. A request is "in prefill" from its dispatch until the engine
reports its first progress; its cost there is its *uncached* prompt: its prompt tokens minus what the engine is
believed to hold for its session (session_table.py), so a session's next turn on the engine that ran its
previous turn costs only its new tokens.

Prefill budget. Optionally, at most `prefill_token_budget` uncached prompt tokens may be in prefill on an engine
at once, so that long-context sessions do not freeze everyone else's decode (a prefill storm). With
prefill-first scheduling (SGLang, reference/engines.md B.2-B.4) an engine prefills its prompts one after the
other while its decodes wait, so a prompt dispatched behind another waits for it anyway: holding it in the
gateway costs it nothing, keeps the engine's own queue short, and lets it go to whichever engine frees first.

Exempt prefills. A request with fewer than `exempt_below_tokens` uncached tokens (the gateway uses the
contention threshold, config.contention_min_prefill_tokens) needs only a slot: it neither waits for nor counts
against the budget. The budget then governs exactly the prefills that freeze other requests' decodes, and a
session's next turn (a second of prefill) is not held back behind a 100K-token prompt: on the engine it queues
behind the prefill in progress and starts right after it. With 0 (the default) every request counts.

Rest. Prefill-first means an engine that prefills prompt after prompt gives its decodes (almost) nothing for as
long as the storm lasts. With a budget and `rest_ratio` r > 0, when the budgeted prefills on an engine end (the budgeted
tokens in prefill drop to 0) after a busy stretch of T seconds, the engine takes no new budgeted prefill for
r x T seconds (exempt ones still go): its decodes, the prompts just prefilled among them, get at least
r / (1 + r) of the engine's time during a storm of long prefills. The rest ends early once nobody decodes there. While resting, the engine reports `rest_tokens` = r x the tokens of that
stretch as backlog to placement (the rest as prefill work a new prompt would wait behind). The gateway owns the
timer that ends the rest (`end_rest`).

Rules:
1. `can_admit(uncached)`: a free slot, and the request is exempt, or (the engine is not resting and) its prompt
   fits the budget next to the budgeted prefills in progress, or no budgeted prefill is in progress (a prompt
   larger than the whole budget still runs, alone, and never starves: see dispatcher.py for the reservation
   that drains the budget for it).
2. Every `admit` is matched by exactly one `release`; `finish_prefill` at most once in between, with the same
   uncached count. Only `finish_prefill` (a prefill that ended with output) can start a rest; a request taken
   off the engine in prefill (`release`) gives its tokens back without one.
3. In wallclock mode the gateway builds slots with capacity and budget math.inf: no admission at all.
"""

from __future__ import annotations

import math

__all__ = ("DEFAULT_CHUNK_TOKENS", "EngineSlots", "default_prefill_budget")

DEFAULT_CHUNK_TOKENS = 8192
"""SGLang's chunked prefill size and vLLM's max_num_batched_tokens on H100/H200 (reference/engines.md B.3, C)."""


def default_prefill_budget(chunked_prefill_size: int | None, capacity: int) -> int:
    """The prefill budget of an engine that reports its chunk size (None: not reported) and request capacity.

    One prefill batch (chunk) per 64 request slots, between 1 and 8 chunks: the chunk is how much prompt the
    engine computes per scheduling step on its hardware (SGLang sizes it by GPU memory), so the budget is a few
    steps of prefill whatever the GPU, and an engine with more slots serves more turns at once, each starting
    with a prefill, so more may be in flight before it matters. With the exemption of small prefills
    (`exempt_below_tokens`) ordinary turns do not count at all; what the budget decides is how many long
    prompts an engine prefills at once, and a 100K-token history (12 chunks of 8,192) is always alone.
    Raises ValueError for a capacity < 1 or a chunk size < 1.
    """
    if capacity < 1 or (chunked_prefill_size is not None and chunked_prefill_size < 1):
        raise ValueError("capacity and chunked_prefill_size must be >= 1")
    chunk = DEFAULT_CHUNK_TOKENS if chunked_prefill_size is None else chunked_prefill_size
    return chunk * min(8, max(1, capacity // 64))


class EngineSlots:
    """Counts of one engine's requests in flight and uncached prompt tokens in prefill."""

    __slots__ = (
        "_burst_at",
        "_burst_tokens",
        "budget_tokens",
        "capacity",
        "exempt_below_tokens",
        "in_flight",
        "is_resting",
        "prefill_token_budget",
        "prefill_tokens",
        "prefilling",
        "rest_ratio",
        "rest_tokens",
    )

    def __init__(
        self,
        *,
        capacity: float,
        prefill_token_budget: float = math.inf,
        exempt_below_tokens: int = 0,
        rest_ratio: float = 0.0,
    ) -> None:
        if exempt_below_tokens < 0:
            raise ValueError("exempt_below_tokens must be >= 0")
        if math.isnan(rest_ratio) or rest_ratio < 0 or math.isinf(rest_ratio):
            raise ValueError(f"rest_ratio must be a finite number >= 0, got {rest_ratio!r}")
        self.capacity = capacity
        self.prefill_token_budget = prefill_token_budget
        self.exempt_below_tokens = exempt_below_tokens
        self.rest_ratio = rest_ratio
        self.in_flight = 0
        self.prefilling = 0  # requests dispatched and not yet past their prefill (no progress yet)
        self.prefill_tokens = 0  # their uncached prompt tokens
        self.budget_tokens = 0  # the part of prefill_tokens that counts against the budget
        self.is_resting = False
        self.rest_tokens = 0
        self._burst_at = 0.0  # when budget_tokens last rose from 0
        self._burst_tokens = 0  # budgeted tokens admitted since then

    # --- readings ----------------------------------------------------------------------------------------

    @property
    def decoding(self) -> int:
        """Requests past their prefill: the decodes a new prefill here would slow."""
        return self.in_flight - self.prefilling

    def has_room(self) -> bool:
        """A free slot (the prefill budget aside)."""
        return self.in_flight < self.capacity

    def is_exempt(self, uncached_tokens: int) -> bool:
        """True if a prefill this small ignores the budget and the rest (and does not count against them)."""
        return uncached_tokens < self.exempt_below_tokens

    def has_budget_for(self, uncached_tokens: int) -> bool:
        """The budget and the rest alone (slots aside) let this many uncached tokens start now."""
        if self.is_exempt(uncached_tokens):
            return True
        if self.is_resting:
            return False
        return self.budget_tokens == 0 or self.budget_tokens + uncached_tokens <= self.prefill_token_budget

    def can_admit(self, uncached_tokens: int) -> bool:
        """A free slot, and `uncached_tokens` may start now as far as the budget and the rest go (rule 1)."""
        return self.in_flight < self.capacity and self.has_budget_for(uncached_tokens)

    # --- changes -----------------------------------------------------------------------------------------

    def admit(self, uncached_tokens: int, now: float) -> None:
        self.in_flight += 1
        self.prefilling += 1
        self.prefill_tokens += uncached_tokens
        if not self.is_exempt(uncached_tokens):
            if self.budget_tokens == 0:
                self._burst_at, self._burst_tokens = now, 0
            self.budget_tokens += uncached_tokens
            self._burst_tokens += uncached_tokens

    def finish_prefill(self, uncached_tokens: int, now: float) -> float:
        """The request's prefill ended with output. Returns when the rest this starts ends (math.inf: none).

        A rest starts when this was the last budgeted prefill in progress, the engine has a budget and
        `rest_ratio` > 0 (the request itself now decodes here); the caller arms a timer for `end_rest`.
        """
        self._give_back(uncached_tokens)
        if (
            self.rest_ratio == 0
            or self.prefill_token_budget == math.inf
            or self.is_exempt(uncached_tokens)
            or self.budget_tokens
            or not self._burst_tokens
        ):
            return math.inf
        self.is_resting = True
        self.rest_tokens = round(self.rest_ratio * self._burst_tokens)
        return now + self.rest_ratio * max(0.0, now - self._burst_at)

    def end_rest(self) -> None:
        """The rest is over (its timer fired, or nobody decodes here any more)."""
        self.is_resting = False
        self.rest_tokens = 0

    def release(self, uncached_tokens: int, *, is_in_prefill: bool) -> None:
        """A request left the engine; its `uncached_tokens` are given back if it was still in prefill.

        Raises ValueError if no request is in flight.
        """
        if self.in_flight <= 0:
            raise ValueError("release without a request in flight")
        self.in_flight -= 1
        if is_in_prefill:
            self._give_back(uncached_tokens)

    def _give_back(self, uncached_tokens: int) -> None:
        self.prefilling -= 1
        self.prefill_tokens -= uncached_tokens
        if not self.is_exempt(uncached_tokens):
            self.budget_tokens -= uncached_tokens

    def __repr__(self) -> str:
        return (
            f"<EngineSlots [{self.in_flight}/{self.capacity:g} in flight, "  # float: 2.0 compiled (setup.py)
            f"{self.prefill_tokens} prefill tokens]>"
        )
