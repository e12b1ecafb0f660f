"""Prometheus text as a scraper reads it (benchmarks/kit/prometheus.py, prometheus_client's parser)."""

from __future__ import annotations

from benchmarks.kit.prometheus import histogram_buckets, quantile_bound, sample_totals


def test_prometheus_samples_are_summed_per_name() -> None:
    text = (
        "# TYPE sim:output_bytes_total counter\n"
        'sim:output_bytes_total{model_name="m",tp_rank="0"} 100.0\n'
        'sim:output_bytes_total{model_name="m",tp_rank="1"} 50\n'
        "sglang:num_requests_total 3\n"
    )
    assert sample_totals(text) == {"sim:output_bytes_total": 150.0, "sglang:num_requests_total": 3.0}


def _lag(counts: tuple[int, int, int]) -> str:
    return (
        "# TYPE lag histogram\n"
        f'lag_bucket{{le="0.01"}} {counts[0]}\n'
        f'lag_bucket{{le="0.1"}} {counts[1]}\n'
        f'lag_bucket{{le="+Inf"}} {counts[2]}\n'
        f"lag_count {counts[2]}\n"
        "lag_sum 1.0\n"
    )


def test_a_histograms_quantile_is_bounded_by_its_bucket_between_two_readings() -> None:
    before = histogram_buckets(_lag((90, 95, 100)), "lag")
    assert before == {0.01: 90.0, 0.1: 95.0, float("inf"): 100.0}
    after = histogram_buckets(
        _lag((180, 190, 200)), "lag"
    )  # between them: 90 under 10 ms, 5 under 100, 5 over
    assert quantile_bound(before, after, 0.5) == 0.01
    assert quantile_bound(before, after, 0.95) == 0.1
    assert quantile_bound(before, after, 0.99) == float("inf")
    assert quantile_bound(after, after, 0.5) is None  # nothing observed between
