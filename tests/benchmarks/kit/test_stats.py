"""The benchmarks' one percentile (benchmarks/kit/stats.py): nearest rank by default, linear on request."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.kit.stats import mean, percentile


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == 99.0
    assert percentile(values, 50) == 50.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize(("values", "q", "expected"), [([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([5.0], 99, 5.0)])
def test_percentile_is_the_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_linear_percentiles_interpolate_between_ranks_as_statistics_does() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # any order
    assert percentile(values, 50, method="linear") == pytest.approx(2.5)
    assert percentile(values, 99, method="linear") == pytest.approx(3.97)
    assert percentile([5.0], 90, method="linear") == 5.0
    assert math.isnan(percentile([], 50, method="linear"))
    data = [float((7 * i) % 31) for i in range(40)]
    inclusive = statistics.quantiles(data, n=100, method="inclusive")
    for q in (1, 50, 90, 99):
        assert percentile(data, q, method="linear") == pytest.approx(inclusive[q - 1])


def test_a_q_outside_0_to_100_or_an_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)
    with pytest.raises(ValueError, match="unknown method"):
        percentile([1.0], 50, method="midpoint")  # type: ignore[arg-type]


def test_mean_of_nothing_is_nan() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert math.isnan(mean([]))
