"""An engine's counters and latency histograms, as plain values the edges read (metrics, /sim/state)."""

from __future__ import annotations

import bisect
from collections import deque

__all__ = ("EngineStats", "Histogram")

_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


class Histogram:
    """Cumulative-bucket histogram of simulated durations."""

    __slots__ = ("counts", "sum", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0
        self.total = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, value)] += 1
        self.sum += value
        self.total += 1

    def lines(self, name: str, labels: str) -> list[str]:
        """Prometheus text lines."""
        out = [f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(_BUCKETS, self.counts, strict=False):
            running += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.total}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.total}")
        return out


class EngineStats:
    """Counters of one engine (health-check requests are never counted)."""

    __slots__ = (
        "_samples",
        "aborted_total",
        "cached_tokens_total",
        "e2e",
        "finished_by_reason",
        "finished_generated_tokens_total",
        "generated_tokens_total",
        "preempted_total",
        "progress_events",
        "prompt_tokens_total",
        "queue_time",
        "requests_total",
        "retracted_total",
        "ttft",
    )

    def __init__(self) -> None:
        self.generated_tokens_total = 0  # live: every token as it is made
        self.finished_generated_tokens_total = 0  # a request's tokens, counted when it finishes
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        self.aborted_total = 0
        self.retracted_total = 0  # every retraction: a `retract` pause's and a KV preemption's
        self.preempted_total = 0  # KV preemptions only (`kv_preemption`)
        self.finished_by_reason: dict[str, int] = {}
        self.progress_events = 0  # steps completed (SGLang's health check watches for any)
        self.ttft = Histogram()
        self.e2e = Histogram()
        # submission to start of prefill (vLLM's request_queue_time_seconds, SGLang's queue_time_seconds)
        self.queue_time = Histogram()
        self._samples: deque[tuple[float, int]] = deque([(0.0, 0)])

    def record_finish(self, kind: str, e2e_s: float, completion_tokens: int = 0) -> None:
        self.finished_by_reason[kind] = self.finished_by_reason.get(kind, 0) + 1
        self.finished_generated_tokens_total += completion_tokens
        if kind == "abort":
            self.aborted_total += 1
        self.e2e.observe(e2e_s)

    def sample(self, now: float) -> None:
        """Remember the token count now and then, for `gen_throughput`."""
        samples = self._samples
        if now - samples[-1][0] >= 0.5:
            samples.append((now, self.generated_tokens_total))
            while len(samples) > 2 and samples[1][0] < now - 10.0:
                samples.popleft()

    def gen_throughput(self, now: float, window_s: float = 5.0) -> float:
        """Generated tokens per simulated second over about the last `window_s`."""
        start_at, start_total = self._samples[0]
        for at, total in self._samples:
            if at >= now - window_s:
                break
            start_at, start_total = at, total
        span = now - start_at
        return (self.generated_tokens_total - start_total) / span if span > 0 else 0.0
