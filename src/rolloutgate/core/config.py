"""The core's settings: one frozen value, validated at construction.

Theory of operation: the edge (rolloutgate.config) resolves flags, files and environment once into a
`GatewayCoreConfig` and hands it to `Gateway`. The defaults here are the production ones: the edge's settings
take theirs from this class (rolloutgate/config.py), so `GatewayCoreConfig()` is the gateway `rolloutgate
serve` runs. Per-request budgets (timeout, stall, queue, wall) travel with each
request (`RequestLimits` in events.py); everything here is pool-wide.

Rules: durations end in `_s` and are >= 0 (math.inf for none); NaN and negative values raise ValueError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from rolloutgate.core.events import ClockMode
from rolloutgate.core.weights import ON_STALE, OnStale

__all__ = ("PLACEMENTS", "GatewayCoreConfig", "Placement")

Placement = Literal[
    "session_affinity",
    "least_outstanding",
    "prefill_aware",
    "cache_warm",
    "consistent_hash",
    "sticky_least_loaded",
]
PLACEMENTS: tuple[Placement, ...] = get_args(Placement)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayCoreConfig:
    """Pool-wide settings of the sans-IO core."""

    clock_mode: ClockMode = ClockMode.ENGINE
    # wait queue
    max_queue: int = 100_000  # waiting requests; beyond it new ones fail with QUEUE_FULL
    retry_after_s: float = 1.0  # Retry-After for QUEUE_FULL and QUEUE_TIMEOUT
    # retries
    max_attempts: int = 3  # dispatches per request counted against faults (refused, hung, stuck)
    # no engine
    no_engine_grace_s: float = 30.0  # no healthy engine for this long: queued fail, new fail at once
    no_engine_retry_after_s: float = 5.0
    # clients
    retry_grace_s: float = 10.0  # after a disconnect, wait this long for a retry to attach before aborting
    # contention and prefill
    contention_min_prefill_tokens: int = 4096  # only prefills of at least this many uncached tokens contend
    prefill_floor_tokens_per_s: float = 2000.0  # conservative prefill speed for the liveness allowance
    max_prefill_allowance_s: float = 300.0  # cap of that allowance
    # prefills with fewer uncached tokens than this neither wait for nor count against an engine's prefill
    # budget (EngineJoined.prefill_token_budget); 0: every prefill counts (see admission.py)
    # (the edge sets it to contention_min_prefill_tokens: the budget governs the prefills that contend)
    prefill_budget_exempt_tokens: int = 4096
    # after an engine's budgeted prefills end, it takes no new budgeted prefill for this times their duration
    # while requests decode there (their share of the engine between long prefills); 0: no rest
    prefill_rest_ratio: float = 0.5
    # placement
    placement: Placement = (
        "prefill_aware"  # "session_affinity", "least_outstanding" (wallclock: least_outstanding)
    )
    affinity_max_excess: int = (
        8  # a session moves when its engine has more than this many in flight above the least loaded
    )
    max_sessions: int = 100_000  # sessions remembered for affinity (LRU)
    # a session's binding is released after this long with nothing of it in flight (session_table.py `expire`)
    session_idle_s: float = 1800.0
    # a session's calls admitted at once (queued or running); those over it wait in order (session_cap.py)
    session_max_in_flight: float = math.inf
    # cache_warm placement: each engine's prefix-cache room for the histories of the sessions bound to it, in
    # tokens; a new session goes where its history fits (placement/cache_warm.py). math.inf: not known
    engine_cache_tokens: float = math.inf
    # liveness
    engine_stall_timeout_s: float = (
        math.inf
    )  # pool-level cap on the engine stall window (min with the requests')
    # a stalled request on a silent engine is looked at again after this (charged) time; and an engine silent
    # this long is not progressing on others (a request stalled with it is the engine's to judge)
    stall_recheck_s: float = 1.0
    # an engine silent for its stall window is asked whether it is paused (CheckEngine: a trainer's pause the
    # health loop has not read yet) this long before the window ends, and judged hung at its end unless it
    # says so (liveness.py "The pause check"; 0: not asked)
    hang_check_s: float = 2.0
    # an engine's first work after it joined or failed a health check may show no progress this long before it
    # is judged hung, if that is longer than its stall window: a compile on the first request (rllm#926: 108 s)
    # looks exactly like a hang from outside (liveness.py "Warm-up"); 0: no warm-up, the stall window applies
    warmup_timeout_s: float = 300.0
    # a request that arrives at an empty queue is placed at once, without passing through the queue: the
    # decision the queue would make for it alone (False: through the queue; the reference the tests compare)
    direct_arrivals: bool = True
    # weight versions (weights.py): a request running since more than this many weight updates ago is stale
    # at the next one (None: no bound), and is then re-queued from scratch or answered with its partial output
    max_staleness: int | None = None
    on_stale: OnStale = "requeue"
    # on_stale "pace": the units of new work (sessions, or calls without a routing key) the trainer consumes per
    # weight version; at most this x (version + max_staleness + 1) are admitted (pace.py)
    pace_batch: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "retry_after_s",
            "no_engine_grace_s",
            "no_engine_retry_after_s",
            "retry_grace_s",
            "max_prefill_allowance_s",
            "engine_stall_timeout_s",
            "hang_check_s",
            "warmup_timeout_s",
        ):
            value = getattr(self, name)
            if math.isnan(value) or value < 0:
                raise ValueError(f"{name} must be >= 0 (math.inf for none), got {value!r}")
        if math.isnan(self.prefill_rest_ratio) or not 0 <= self.prefill_rest_ratio < math.inf:
            raise ValueError(
                f"prefill_rest_ratio must be a finite number >= 0, got {self.prefill_rest_ratio!r}"
            )
        if not (self.prefill_floor_tokens_per_s > 0 and self.stall_recheck_s > 0):
            raise ValueError("prefill_floor_tokens_per_s and stall_recheck_s must be > 0")
        if self.engine_stall_timeout_s == 0:
            raise ValueError("engine_stall_timeout_s must be > 0")
        if not self.session_max_in_flight >= 1:
            raise ValueError("session_max_in_flight must be >= 1 (math.inf: no cap)")
        if not self.session_idle_s > 0:
            raise ValueError("session_idle_s must be > 0 (math.inf: never)")
        for name in ("max_queue", "max_attempts", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("contention_min_prefill_tokens", "affinity_max_excess", "prefill_budget_exempt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (None: off), got {self.max_staleness!r}")
        if self.on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {ON_STALE}, got {self.on_stale!r}")
        if (self.on_stale == "pace") != (self.pace_batch is not None) or (
            self.on_stale == "pace" and self.max_staleness is None
        ):
            raise ValueError(
                "on_stale 'pace' needs max_staleness and pace_batch, and pace_batch needs 'pace'"
            )
        if self.pace_batch is not None and self.pace_batch < 1:
            raise ValueError(f"pace_batch must be >= 1, got {self.pace_batch!r}")
        if math.isnan(self.engine_cache_tokens) or self.engine_cache_tokens <= 0:
            raise ValueError(
                f"engine_cache_tokens must be > 0 (math.inf: unknown), got {self.engine_cache_tokens!r}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
