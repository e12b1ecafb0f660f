"""Per-engine liveness: an engine with work that shows no progress at all for its stall window is hung.

Theory of operation
-------------------
Liveness is judged per engine, the budget per request (DESIGN.md). An engine is *watched* while it has requests
in flight, is not paused (EnginePaused), and the gate is not closed in IN_PLACE mode. While watched, it is hung
when no in-flight request made progress for its stall window:

    stall    = min(stall_timeout_s of its in-flight requests, the pool's engine_stall_timeout_s)
    window   = stall, or max(stall, warmup_s) while the engine is cold; + prefill allowance
    due_at   = max(last progress on the engine, when it became busy, when it was resumed) + window

The window starts when the engine became busy (0 -> 1 in flight) or was resumed, never earlier: an engine that
was idle or paused for an hour is not "silent for an hour" the moment it gets work.

Warm-up. An engine's first work may legitimately show nothing for minutes: SGLang compiles kernels or captures
graphs for the shapes its first client request brings (rllm#926: 108 s on one chat request), and during the
compile its forward pass does not return, so its `/health` (which generates a token) and its scheduler's
control round trips hang exactly as they do when the GPU hangs; nothing the engine shows tells the two apart.
Time does: an engine is *cold* from when it joined, and from its last failed health check (it may be a new
process starting, which compiles again), until it shows its first progress. While cold its stall window is
at least `warmup_s` (the pool's `warmup_timeout_s`, 300 s by default): a compile under that is busy, not
dead, and an engine frozen on its first work is still caught, after `warmup_s` instead of its stall timeout.
Once it progressed, the stall window alone applies again. A quarantine lifted by a passing health check does
not make an engine cold: it was seen alive and hung, and gets no new warm-up.

Prefill allowance. A large prefill legitimately shows no progress: with prefill-first scheduling (SGLang, see
reference/engines.md B.3) the engine's running decodes get nothing during a 30-40 s prefill of a 100K-token
prompt, and several queued prefills run back to back. While large prefills (>= contention_min_prefill_tokens
uncached) are in progress on the engine, the window grows by the time those prompts need at a conservative
floor rate, capped:

    allowance = min(max_prefill_allowance_s, large prefill tokens in progress / prefill_floor_tokens_per_s)

With the defaults (2,000 tok/s, cap 300 s), one 100K prefill adds 50 s: a 40 s prefill under a 60 s stall
timeout is not a hang, and an engine frozen with that prefill in progress is caught after at most 110 s. With no
large prefill in progress the allowance is 0 and a frozen engine is caught exactly `stall_timeout_s` after its
last progress (the deadlines are exact; there is no polling).

The pause check. A trainer may pause the engine itself and tell nobody; the edge's health loop reads that
(`EnginePaused`) within a health interval and two round trips, which on a loaded machine can outlast a short
stall window. So `hang_check_s` before `due_at` the gateway asks the edge to read the engine's pause flag
(CheckEngine), and judges it hung at `due_at` if nothing changed: the verdict never races the health loop, and
the question costs the verdict no time (a frozen engine is caught `stall_timeout_s` after its last progress, not
later). A check asked late (a window shorter than the check, a timer that fired late) still gets its
`hang_check_s` before the verdict. One check per silence (`ask_check`); progress or a resume starts a new
silence.

Progress (the hot path) only stores `last_progress_at`; the gateway's timer for the engine is lazy: when it fires
the due time is recomputed, and the timer is set again if progress moved it.

Rules:
1. The minimum stall timeout is kept as counts plus a lazy min-heap of distinct values: O(log d) per change.
2. This module judges engines only; a request stuck alone is judged by its clock (request_clock.py).
3. Being cold costs the hot path nothing: it is `last_progress_at <= cold_since_at`, read when a deadline is
   computed.
"""

from __future__ import annotations

import heapq
import math

__all__ = ("EngineLiveness", "prefill_allowance_s")


def prefill_allowance_s(prefill_tokens: int, *, floor_tokens_per_s: float, max_allowance_s: float) -> float:
    """Time `prefill_tokens` of uncached prompt legitimately take at the floor rate, capped."""
    if prefill_tokens <= 0:
        return 0.0
    return min(max_allowance_s, prefill_tokens / floor_tokens_per_s)


class EngineLiveness:
    """One engine's progress record and stall window; see the module docstring."""

    __slots__ = (
        "_counts",
        "_heap",
        "checked_at",
        "checked_since",
        "cold_since_at",
        "large_prefill_tokens",
        "last_progress_at",
        "last_token_at",
        "pool_stall_timeout_s",
        "window_start_at",
    )

    def __init__(self, *, now: float, pool_stall_timeout_s: float = math.inf) -> None:
        self.last_progress_at = -math.inf
        self.last_token_at = -math.inf  # the last progress a call's own answer showed (not a counter reading)
        self.window_start_at = now
        self.cold_since_at = now  # it joined: cold until its first progress (warm-up, module docstring)
        self.large_prefill_tokens = 0
        self.pool_stall_timeout_s = pool_stall_timeout_s
        self.checked_since = math.nan  # the silence (its `silent_since_at`) whose pause check was asked for
        self.checked_at = -math.inf  # when
        self._counts: dict[float, int] = {}
        self._heap: list[float] = []

    def add_request(self, stall_timeout_s: float) -> None:
        count = self._counts.get(stall_timeout_s, 0)
        if count == 0:
            heapq.heappush(self._heap, stall_timeout_s)
        self._counts[stall_timeout_s] = count + 1

    def remove_request(self, stall_timeout_s: float) -> None:
        count = self._counts[stall_timeout_s] - 1
        if count:
            self._counts[stall_timeout_s] = count
        else:
            del self._counts[stall_timeout_s]

    def note_busy(self, now: float) -> None:
        """The engine went from idle to having work: its window starts now."""
        self.window_start_at = now

    def note_resumed(self, now: float) -> None:
        """The engine (or the gate) was resumed: its window starts again now."""
        self.window_start_at = now

    def note_cold(self, now: float) -> None:
        """The engine may be a new process (it failed a health check): cold until its next progress."""
        self.cold_since_at = now

    def is_cold(self) -> bool:
        """No progress since it joined or last failed a health check: its first work may be a compile."""
        return self.last_progress_at <= self.cold_since_at  # progress at the instant it failed came before

    def min_stall_timeout_s(self) -> float:
        heap = self._heap
        while heap and heap[0] not in self._counts:
            heapq.heappop(heap)
        own = heap[0] if heap else math.inf
        return min(own, self.pool_stall_timeout_s)

    def silent_since_at(self, last_output_at: float | None = None) -> float:
        """Since when it has shown nothing: its last progress, or when it got work or was resumed if later.
        `last_output_at`, the edge's reading of when its last token came (its counter), stands for the
        progress read from that counter; a token a call streamed later still counts."""
        last = self.last_progress_at if last_output_at is None else max(last_output_at, self.last_token_at)
        return max(last, self.window_start_at)

    def ask_check(self, now: float) -> bool:
        """This silence is due for its pause check: True the first time (ask the engine whether it is
        paused)."""
        silent_since = self.silent_since_at()
        if self.checked_since == silent_since:
            return False
        self.checked_since, self.checked_at = silent_since, now
        return True

    def judged_at(self, due_at: float, check_s: float) -> float:
        """When a silence due at `due_at` is judged: at `due_at`, its pause check asked `check_s` before;
        a check asked later than that (for this silence: progress or a resume starts a new one) still gets
        its `check_s`."""
        if self.checked_since != self.silent_since_at():
            return due_at
        return max(due_at, self.checked_at + check_s)

    def next_step_at(self, due_at: float, check_s: float) -> float:
        """When the gateway next acts on this silence: its pause check `check_s` before `due_at` (once per
        silence), then its verdict (`judged_at`)."""
        if check_s > 0 and self.checked_since != self.silent_since_at():
            return due_at - check_s
        return self.judged_at(due_at, check_s)

    def window_s(self, warmup_s: float) -> float:
        """Its stall window before the prefill allowance: at least `warmup_s` while it is cold."""
        stall_s = self.min_stall_timeout_s()
        return max(stall_s, warmup_s) if self.is_cold() else stall_s

    def due_at(self, *, floor_tokens_per_s: float, max_allowance_s: float, warmup_s: float = 0.0) -> float:
        """When the engine counts as hung if nothing changes (the caller checks that it is watched)."""
        allowance = prefill_allowance_s(
            self.large_prefill_tokens, floor_tokens_per_s=floor_tokens_per_s, max_allowance_s=max_allowance_s
        )
        return self.silent_since_at() + self.window_s(warmup_s) + allowance

    def __repr__(self) -> str:
        return (
            f"<EngineLiveness silent since {self.silent_since_at():.3f}, "
            f"min stall {self.min_stall_timeout_s():.1f}s, {self.large_prefill_tokens} large prefill tokens"
            f"{', cold' if self.is_cold() else ''}>"
        )
