"""The session registry's observable state, as a value (metrics are produced at the edge from it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ("MetricSample", "RegistryStats")

# (metric name, Prometheus type, help, labels, value)
MetricSample = tuple[str, str, str, dict[str, str], float]


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryStats:
    sessions: int
    sessions_busy: int  # sessions with a turn in flight
    turns_in_flight: int
    records: int
    approx_bytes: int
    max_sessions: int
    max_records_per_session: int
    idle_ttl_s: float
    max_bytes: int
    created_total: int
    deleted_total: int
    evicted_idle_ttl_total: int
    evicted_capacity_total: int
    evicted_memory_total: int
    rejected_full_total: int
    turns_committed_total: int
    turns_abandoned_total: int
    turns_rolled_back_total: int
    duplicate_commits_total: int
    diverged_total: int
    busy_total: int
    record_limit_total: int

    def metric_samples(self) -> list[MetricSample]:
        """Prometheus samples: gauges for state and configured limits, counters for what happened."""
        g, c = "gauge", "counter"
        return [
            ("rolloutgate_sessions", g, "Sessions held", {}, self.sessions),
            ("rolloutgate_sessions_busy", g, "Sessions with a turn in flight", {}, self.sessions_busy),
            ("rolloutgate_session_turns_in_flight", g, "Session turns in flight", {}, self.turns_in_flight),
            ("rolloutgate_session_records", g, "Turn records held, all sessions", {}, self.records),
            ("rolloutgate_sessions_bytes", g, "Approximate bytes held by sessions", {}, self.approx_bytes),
            ("rolloutgate_sessions_max", g, "Configured maximum number of sessions", {}, self.max_sessions),
            (
                "rolloutgate_session_records_max",
                g,
                "Configured maximum turns per session",
                {},
                self.max_records_per_session,
            ),
            (
                "rolloutgate_sessions_idle_ttl_seconds",
                g,
                "Configured idle TTL (inf: none)",
                {},
                self.idle_ttl_s,
            ),
            ("rolloutgate_sessions_bytes_max", g, "Configured memory bound for sessions", {}, self.max_bytes),
            ("rolloutgate_sessions_created_total", c, "Sessions created", {}, self.created_total),
            (
                "rolloutgate_sessions_deleted_total",
                c,
                "Sessions deleted by their client",
                {},
                self.deleted_total,
            ),
            (
                "rolloutgate_sessions_evicted_total",
                c,
                "Sessions evicted",
                {"reason": "idle_ttl"},
                self.evicted_idle_ttl_total,
            ),
            (
                "rolloutgate_sessions_evicted_total",
                c,
                "Sessions evicted",
                {"reason": "capacity"},
                self.evicted_capacity_total,
            ),
            (
                "rolloutgate_sessions_evicted_total",
                c,
                "Sessions evicted",
                {"reason": "memory"},
                self.evicted_memory_total,
            ),
            (
                "rolloutgate_sessions_rejected_total",
                c,
                "Session creations refused (full)",
                {},
                self.rejected_full_total,
            ),
            (
                "rolloutgate_session_turns_total",
                c,
                "Session turns by outcome",
                {"outcome": "committed"},
                self.turns_committed_total,
            ),
            (
                "rolloutgate_session_turns_total",
                c,
                "Session turns by outcome",
                {"outcome": "abandoned"},
                self.turns_abandoned_total,
            ),
            (
                "rolloutgate_session_turns_total",
                c,
                "Session turns by outcome",
                {"outcome": "rolled_back"},
                self.turns_rolled_back_total,
            ),
            (
                "rolloutgate_session_turns_total",
                c,
                "Session turns by outcome",
                {"outcome": "duplicate"},
                self.duplicate_commits_total,
            ),
            (
                "rolloutgate_session_turns_rejected_total",
                c,
                "Session turns refused",
                {"code": "session_diverged"},
                self.diverged_total,
            ),
            (
                "rolloutgate_session_turns_rejected_total",
                c,
                "Session turns refused",
                {"code": "session_busy"},
                self.busy_total,
            ),
            (
                "rolloutgate_session_turns_rejected_total",
                c,
                "Session turns refused",
                {"code": "session_record_limit"},
                self.record_limit_total,
            ),
        ]
