"""Prometheus text read as any scraper reads it: prometheus_client's own parser, no hand-written one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ("sample_totals",)


def sample_totals(text: str) -> dict[str, float]:
    """Every sample's value summed per sample name (`<counter>_total`, `<histogram>_bucket`, ...), labels
    dropped: the engines' counters over all their label sets."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out
