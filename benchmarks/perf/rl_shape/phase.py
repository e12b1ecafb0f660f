"""One phase of the RL shape: what each turn got (`TurnResult`), the sampler's readings (`Sample`), and the
figures derived from them (`PhaseResult`: per request, per token, per body byte, latency percentiles, the
neighbours' share of our CPUs), plus the ratio arithmetic the verdicts share."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.kit.stats import percentile

__all__ = ("PhaseResult", "Sample", "TurnResult", "added_pct", "ratio")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    if math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


def added_pct(value: float | None, reference: float | None) -> float | None:
    """`value` over `reference`, in percent of the reference (+1.0 = 1% longer)."""
    r = ratio(value, reference)
    return None if r is None else 100.0 * (r - 1.0)


@dataclass(slots=True)
class TurnResult:
    worker: int
    index: int
    status: int  # HTTP status; 0: transport error; -1: cut (phase cap); -2: skipped (session failed earlier)
    latency_s: float = math.nan
    body_bytes: int = 0
    response_bytes: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Sample:
    t: float
    in_flight: int
    in_flight_bytes: int
    rss: int


@dataclass(slots=True)
class PhaseResult:
    name: str
    wall_s: float
    turns_planned: int
    results: list[TurnResult]
    cut: bool
    engine: dict[str, float]  # counter deltas summed over the engines (bytes, chunks, tokens, requests, ...)
    engine_requests: list[float]  # requests per engine (sglang:num_requests_total deltas)
    work_source: str  # "sim:output_*_total" or the fallback's name
    gateway_cpu_s: float | None
    sim_cpu_s: float
    client_cpu_s: float
    idle_rss: int | None
    samples: list[Sample] = field(default_factory=list)
    ideal_s: dict[tuple[int, int], float] = field(default_factory=dict)
    cpu_busy_s: dict[int, float] = field(default_factory=dict)  # each CPU's busy seconds over the phase
    server_cpus: tuple[int, ...] = ()
    client_cpus: tuple[int, ...] = ()
    # the gateway's own event-loop lag over the phase (rolloutgate's /metrics: server/loop_lag.py), each
    # quantile as its histogram bucket's upper bound; None for a gateway that does not export it
    loop_lag: dict[str, float | None] | None = None

    # -- derived

    @property
    def ok(self) -> list[TurnResult]:
        return [r for r in self.results if r.status == 200]

    @property
    def generated_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    def count(self, status: int) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.results if r.status not in (200, -1, -2))

    @property
    def latencies(self) -> dict[tuple[int, int], float]:
        return {(r.worker, r.index): r.latency_s for r in self.ok}

    def p(self, q: float) -> float:
        return percentile(list(self.latencies.values()), q, method="linear")

    @property
    def bytes_per_request(self) -> float | None:
        return ratio(self.engine.get("output_bytes"), len(self.ok))

    @property
    def chunks_per_request(self) -> float | None:
        return ratio(self.engine.get("output_chunks"), len(self.ok))

    @property
    def bytes_per_token(self) -> float | None:
        return ratio(self.engine.get("output_bytes"), self.engine.get("generated_tokens"))

    @property
    def cpu_per_million_tokens(self) -> float | None:
        if self.gateway_cpu_s is None:
            return None
        return ratio(1e6 * self.gateway_cpu_s, self.generated_tokens)

    @property
    def peak(self) -> Sample | None:
        """The sample with the most request-body bytes in flight."""
        return max(self.samples, key=lambda s: (s.in_flight_bytes, s.t)) if self.samples else None

    @property
    def rss_per_body(self) -> float | None:
        peak = self.peak
        if peak is None or self.idle_rss is None or peak.rss <= 0:
            return None
        return ratio(peak.rss - self.idle_rss, peak.in_flight_bytes)

    @property
    def max_rss(self) -> int | None:
        values = [s.rss for s in self.samples if s.rss > 0]
        return max(values) if values else None

    @property
    def stretch_p50(self) -> float:
        """Median of latency / ideal (the simulated decode of the turn in real seconds): 1.0 = no lag."""
        values = [lat / self.ideal_s[k] for k, lat in self.latencies.items() if self.ideal_s.get(k)]
        return percentile(values, 50, method="linear")

    @property
    def cache_hit(self) -> float | None:
        return ratio(self.engine.get("cached_tokens"), self.engine.get("prompt_tokens"))

    def neighbours_cores(self) -> dict[str, float | None]:
        """CPU time on our CPUs that none of this benchmark's processes used (the shared VM's neighbours),
        in cores: the client CPU's busy time less the simulator's and the clients', the server CPU's less the
        gateway's (None without pinning)."""
        if not self.wall_s or not self.client_cpus:
            return {"client_cpu": None, "server_cpu": None}
        client = (
            sum(self.cpu_busy_s.get(c, 0.0) for c in self.client_cpus) - self.sim_cpu_s - self.client_cpu_s
        )
        server = sum(self.cpu_busy_s.get(c, 0.0) for c in self.server_cpus) - (self.gateway_cpu_s or 0.0)
        return {"client_cpu": max(0.0, client) / self.wall_s, "server_cpu": max(0.0, server) / self.wall_s}

    def summary(self) -> dict[str, Any]:
        peak = self.peak
        return {
            "name": self.name,
            "wall_s": round(self.wall_s, 2),
            "turns_planned": self.turns_planned,
            "turns_ok": len(self.ok),
            "failed": self.failures,
            "cut": self.count(-1),
            "skipped": self.count(-2),
            "phase_cut_at_cap": self.cut,
            "errors": sorted({r.error for r in self.results if r.error})[:10],
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": round(self.generated_tokens / self.wall_s) if self.wall_s else None,
            "engine_counters": self.engine,
            "engine_requests": self.engine_requests,
            "output_work_source": self.work_source,
            "output_bytes_per_request": self.bytes_per_request,
            "output_chunks_per_request": self.chunks_per_request,
            "output_bytes_per_token": self.bytes_per_token,
            "cache_hit": self.cache_hit,
            "gateway_cpu_s": self.gateway_cpu_s,
            "gateway_cpu_s_per_million_tokens": self.cpu_per_million_tokens,
            "gateway_cores": None if self.gateway_cpu_s is None else self.gateway_cpu_s / self.wall_s,
            "sim_cores": self.sim_cpu_s / self.wall_s if self.wall_s else None,
            "client_cores": self.client_cpu_s / self.wall_s if self.wall_s else None,
            "neighbours_cores": self.neighbours_cores(),
            "idle_rss_mb": None if self.idle_rss is None else self.idle_rss / 1e6,
            "max_rss_mb": None if self.max_rss is None else self.max_rss / 1e6,
            "peak": None if peak is None else asdict(peak),
            "rss_per_body_byte": self.rss_per_body,
            "loop_lag_s": self.loop_lag,
            "latency_p50_s": self.p(50),
            "latency_p99_s": self.p(99),
            "stretch_p50": self.stretch_p50,
            "request_body_mb_mean": sum(r.body_bytes for r in self.ok) / len(self.ok) / 1e6
            if self.ok
            else None,
            "response_mb_mean": sum(r.response_bytes for r in self.ok) / len(self.ok) / 1e6
            if self.ok
            else None,
            "samples": [[round(s.t, 2), s.in_flight, s.in_flight_bytes, s.rss] for s in self.samples],
            "turns": [
                [r.worker, r.index, r.status, None if math.isnan(r.latency_s) else round(r.latency_s, 4)]
                for r in self.results
            ],
        }
