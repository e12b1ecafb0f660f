"""Prometheus text as a scraper reads it (benchmarks/kit/prometheus.py, prometheus_client's parser)."""

from __future__ import annotations

from benchmarks.kit.prometheus import sample_totals


def test_prometheus_samples_are_summed_per_name() -> None:
    text = (
        "# TYPE sim:output_bytes_total counter\n"
        'sim:output_bytes_total{model_name="m",tp_rank="0"} 100.0\n'
        'sim:output_bytes_total{model_name="m",tp_rank="1"} 50\n'
        "sglang:num_requests_total 3\n"
    )
    assert sample_totals(text) == {"sim:output_bytes_total": 150.0, "sglang:num_requests_total": 3.0}
