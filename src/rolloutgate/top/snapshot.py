"""What one reading of a gateway holds: its `/admin/state` and its `/metrics` samples, at a moment.

Plain values, no I/O (fetch.py makes them, view.py reads them), so the view model is tested on hand-made ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ("GatewaySnapshot", "Labels", "MetricSamples", "parse_metrics")

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True, slots=True)
class MetricSamples:
    """Prometheus samples by name, then by their labels."""

    by_name: Mapping[str, Mapping[Labels, float]] = field(default_factory=dict)

    def has(self, name: str) -> bool:
        """Whether the gateway exports `name` (a counter with no sample yet counts)."""
        return name in self.by_name

    def total(self, name: str, **match: str) -> float:
        """The sum of the samples of `name` whose labels include `match` (0 if there are none)."""
        wanted = set(match.items())
        return sum(v for labels, v in self.by_name.get(name, {}).items() if wanted <= set(labels))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """The samples of `name` summed by the value of one label."""
        out: dict[str, float] = {}
        for labels, value in self.by_name.get(name, {}).items():
            key = dict(labels).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + value
        return out


def parse_metrics(text: str) -> MetricSamples:
    """Prometheus text (a gateway's `/metrics`) -> samples, with prometheus_client's own parser.
    Raises ValueError on text it cannot parse."""
    by_name: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "counter":  # a labelled counter none of whose labels was used yet is still exported
            by_name.setdefault(family.name + "_total", {})
        for sample in family.samples:
            by_name.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return MetricSamples(by_name)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySnapshot:
    """One gateway (a replica of a fleet, or the gateway alone) read at `taken_at` (real seconds, the reader's
    monotonic clock). `error` says why it could not be read; then state and samples are empty."""

    url: str
    replica_id: str | None
    taken_at: float
    state: Mapping[str, Any] = field(default_factory=dict)
    samples: MetricSamples = field(default_factory=MetricSamples)
    error: str | None = None

    @property
    def engines(self) -> Iterable[Mapping[str, Any]]:
        engines = self.state.get("engines", [])
        return engines if isinstance(engines, list) else []

    @property
    def key(self) -> str:
        return self.replica_id or self.url
