"""Prometheus metrics of the gateway (one registry per app, so tests can run several gateways)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from rolloutgate.core.timing import TimingBreakdown
from rolloutgate.server.loop_lag import LAG_BUCKETS

__all__ = ("CLOCKS", "CLOCK_BUCKETS", "LightCounter", "LightHistograms", "Metrics")

# Seconds, from sub-second queue waits to the incident's 900 s retry chains.
CLOCK_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1800, float("inf"))
CLOCKS = ("wall", "queue", "paused", "contention", "charged")


class _StateCollector(Collector):
    """Gauges read from the core and the pool at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        state = self._read()
        queue = GaugeMetricFamily("rolloutgate_queue_depth", "Requests waiting in the gateway queue")
        queue.add_metric([], state.get("queue_depth", 0))
        yield queue
        oldest = GaugeMetricFamily(
            "rolloutgate_queue_oldest_seconds",
            "The longest a waiting request has waited, on the queue clock (a closed gate not counted)",
        )
        oldest.add_metric([], state.get("queue_oldest_s", 0.0))
        yield oldest
        in_flight = GaugeMetricFamily(
            "rolloutgate_in_flight", "Requests dispatched to each engine", labels=["engine"]
        )
        for engine, count in state.get("in_flight", {}).items():
            in_flight.add_metric([engine], count)
        yield in_flight
        states = GaugeMetricFamily(
            "rolloutgate_engine_state", "1 for the engine's current state", labels=["engine", "state"]
        )
        for engine, engine_state in state.get("engine_states", {}).items():
            states.add_metric([engine, engine_state], 1)
        yield states
        gate = GaugeMetricFamily(
            "rolloutgate_gate_state",
            "1 for the gate's state: open or the mode it is closed in",
            labels=["state"],
        )
        if "gate" in state:
            gate.add_metric([state["gate"]], 1)
        yield gate
        for name, value in state.get("extra", {}).items():
            gauge = GaugeMetricFamily(f"rolloutgate_{name}", name.replace("_", " "))
            gauge.add_metric([], value)
            yield gauge


class LightCounter(Collector):
    """A label-less counter for the hottest paths (one `inc` per upstream event): a plain number, no lock.
    prometheus_client's Counter takes a lock and two calls per `inc`; the gateway runs on one event loop
    thread, so nothing races. Exported as `<name>_total`, like a Counter."""

    def __init__(self, name: str, documentation: str, *, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self.value = 0.0
        registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self._name, self._documentation, value=self.value)


class LightHistograms(Collector):
    """One histogram per value of a single label (e.g. one per clock), for the hottest paths: an observation
    is a bisect and two additions on plain lists, no lock. prometheus_client's Histogram takes a lock and
    walks every bucket per `observe` (~2 us; each request observes five clocks). The gateway runs on one event
    loop thread, so nothing races. Exported exactly as a labelled Histogram (cumulative `le` buckets, `_sum`,
    `_count`)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        label: str,
        values: Iterable[str],
        buckets: Iterable[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._name = name
        self._documentation = documentation
        self._label = label
        self._values = tuple(values)
        self._bounds = tuple(bounds)
        # per label value: counts per bucket (not cumulative; a value falls in the first bucket >= it)
        self.counts = [[0] * len(bounds) for _ in self._values]
        self.sums = [0.0] * len(self._values)
        registry.register(self)

    def observe(self, index: int, value: float) -> None:
        """Observe `value` in the histogram of the `index`-th label value."""
        self.counts[index][bisect_left(self._bounds, value)] += 1
        self.sums[index] += value

    def observe_each(self, values: Sequence[float]) -> None:
        """Observe `values[i]` in the histogram of the `i`-th label value, for each i (one call a request)."""
        bounds, counts, sums = self._bounds, self.counts, self.sums
        for index, value in enumerate(values):
            counts[index][bisect_left(bounds, value)] += 1
            sums[index] += value

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, counts, total in zip(self._values, self.counts, self.sums, strict=True):
            cumulative, buckets = 0, []
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([value], buckets, total)
        yield family


Sample = tuple[str, str, str, dict[str, str], float]


class _SampleCollector(Collector):
    def __init__(self, read: Callable[[], Iterable[Sample]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        for name, kind, help_text, labels, value in self._read():
            family = families.get(name)
            if family is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = families[name] = cls(name, help_text, labels=list(labels))
            family.add_metric(list(labels.values()), value)
        return families.values()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._children: dict[tuple[Counter, str], Any] = {}  # `child`
        self.requests = Counter("rolloutgate_requests", "Requests received", ["route"], registry=r)
        self.clock_seconds = LightHistograms(
            "rolloutgate_clock_seconds",
            "Each clock of finished requests",
            label="clock",
            values=CLOCKS,
            buckets=CLOCK_BUCKETS,
            registry=r,
        )
        self._clocks_of = attrgetter(*(f"{clock}_s" for clock in CLOCKS))  # one tuple of the clocks, in order
        self.failures = Counter("rolloutgate_failures", "Requests failed, by reason", ["reason"], registry=r)
        self.wasted_engine_seconds = Counter(
            "rolloutgate_wasted_engine_seconds",
            "Engine seconds (the charged clock) of requests that failed or were aborted, by failure reason",
            ["reason"],
            registry=r,
        )
        self.aborts = Counter("rolloutgate_aborts_sent", "Aborts sent to engines", ["reason"], registry=r)
        self.stale_requests = Counter(  # the staleness bound (core/weights.py); action: requeued | partial
            "rolloutgate_stale_requests",
            "Requests past max_staleness at a weight update, by what became of them",
            ["action"],
            registry=r,
        )
        self.redispatches = Counter("rolloutgate_redispatches", "Requests sent to another engine", registry=r)
        self.continuations = Counter(
            "rolloutgate_continuations",
            "New attempts of a call that had output: continued from its last token, or started over (a call "
            "answered whole that cannot be continued: not a single /generate prompt, or no chunk came yet)",
            ["outcome"],
            registry=r,
        )
        self.quarantines = Counter(
            "rolloutgate_engine_quarantines",
            "Times an engine was caught hung and quarantined",
            ["engine"],
            registry=r,
        )
        self.calls_lost = Counter(
            "rolloutgate_engine_calls_lost",
            "Calls an engine dropped without finishing its answer (its process died, or it reset the connection)",
            ["engine"],
            registry=r,
        )
        self.generated_tokens = LightCounter(
            "rolloutgate_generated_tokens", "Output tokens seen from engines", registry=r
        )
        self.bad_requests = Counter(
            "rolloutgate_bad_requests", "Requests refused as invalid", ["code"], registry=r
        )
        self.keepalive_bytes = Counter(
            "rolloutgate_keepalive_bytes", "Keep-alive bytes written to clients", ["kind"], registry=r
        )
        self.client_disconnects = Counter(
            "rolloutgate_client_disconnects", "Clients that left before their answer", registry=r
        )
        self.engine_seconds_saved = Counter(
            "rolloutgate_engine_seconds_saved",
            "Engine seconds not spent on generations whose clients left (estimated at their own rate)",
            registry=r,
        )
        self.attachments = Counter(
            "rolloutgate_attachments", "Retries that attached to an existing generation", ["kind"], registry=r
        )
        self.budget_tokens_saved = Counter(  # session token budgets (rolloutgate/token_budget.py)
            "rolloutgate_budget_tokens_saved",
            "Output tokens asked for (max_new_tokens / max_tokens) that a token budget did not allow",
            registry=r,
        )
        # groups (core/group_table.py) and each engine's prefix-cache hits (server/cache_hits.py); docs/rl.md
        self.groups = Counter("rolloutgate_groups", "Groups ended, by outcome", ["outcome"], registry=r)
        self.engine_pause_aborts = Counter(  # settings.engine_pause_aborts rerun: what each unasked abort became
            "rolloutgate_engine_pause_aborts",
            "Calls an engine aborted unasked: rerun (its own pause did it) or passed (an abort sent to it)",
            ["action"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "rolloutgate_event_loop_lag_seconds",
            "How late the event loop ran a timer due (one every 250 ms): the gateway's own saturation",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.group_completion_seconds = Histogram(
            "rolloutgate_group_completion_seconds",
            "A group's first arrival to its last member's end (its slowest sibling)",
            buckets=CLOCK_BUCKETS,
            registry=r,
        )
        self.group_prefill_tokens_saved = Counter(
            "rolloutgate_group_prefill_tokens_saved",
            "Prompt tokens group members were placed to find cached by a sibling (the placement's estimate)",
            registry=r,
        )
        self.engine_prompt_tokens = Counter(
            "rolloutgate_engine_prompt_tokens",
            "Prompt tokens of answered calls, by engine",
            ["engine"],
            registry=r,
        )
        self.engine_cached_tokens = Counter(
            "rolloutgate_engine_cached_tokens",
            "Prompt tokens the engine reported as prefix-cache hits, by engine",
            ["engine"],
            registry=r,
        )

    def child(self, metric: Counter, value: str) -> Any:
        """`metric.labels(value)` for a metric of one label, resolved once per value: `labels()` takes a lock
        and builds its key on every call, a visible share of a short request's CPU. Label values here are
        bounded (routes, engines)."""
        found = self._children.get((metric, value))
        if found is None:
            found = self._children[(metric, value)] = metric.labels(value)
        return found

    def watch(self, read: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_StateCollector(read))

    def watch_samples(self, read: Callable[[], Iterable[Sample]]) -> None:
        """Export samples a part computes itself (name, "gauge"|"counter", help, labels, value) at scrape."""
        self.registry.register(_SampleCollector(read))

    def observe_timing(self, timing: TimingBreakdown, outcome: str) -> None:
        """Observe a finished request's clocks; `outcome` is "ok" or the failure reason (a FailReason value).
        The charged clock of a failed or aborted request is engine time that produced no answer."""
        self.clock_seconds.observe_each(self._clocks_of(timing))
        if outcome != "ok":
            self.wasted_engine_seconds.labels(reason=outcome).inc(timing.charged_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
