"""Prometheus text read as any scraper reads it: prometheus_client's own parser, no hand-written one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ("histogram_buckets", "quantile_bound", "sample_totals")


def sample_totals(text: str) -> dict[str, float]:
    """Every sample's value summed per sample name (`<counter>_total`, `<histogram>_bucket`, ...), labels
    dropped: the engines' counters over all their label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """The cumulative count per bucket bound (`le`) of histogram `name`, summed over its label sets."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                out[bound] = out.get(bound, 0.0) + float(sample.value)
    return out


def quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The bound of the first bucket that holds the `q` quantile of what was observed between two readings of
    one histogram: the quantile rounded up to the bucket's edge (None when nothing was observed)."""
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    if not deltas or deltas[-1] <= 0:
        return None
    for bound, count in zip(bounds, deltas, strict=True):
        if count >= q * deltas[-1]:
            return bound
    return bounds[-1]
