"""The benchmarks' one percentile.

Two methods, named as numpy names them, because the benchmarks report both kinds of figure and each kind has
kept its method since it was first published (docs/benchmarks.md, docs/prefill.md, docs/rl.md):

- `nearest_rank` (the default): the smallest value with at least q% of the values at or below it, always one
  of the values: the figures of the replays and the virtual-time worlds (turn latencies, group completions);
- `linear`: interpolated between the two closest ranks (numpy's default, `statistics.quantiles(method=
  "inclusive")`): the measured latencies of the performance runs (rl-shape, the fleet's costs).

`q` is in [0, 100]; no values give NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

__all__ = ("Method", "mean", "percentile")

Method = Literal["nearest_rank", "linear"]


def percentile(values: Sequence[float], q: float, *, method: Method = "nearest_rank") -> float:
    """The q-th percentile (q in [0, 100]) of `values` (in any order); NaN when there are none.

    Raises ValueError for a `q` outside [0, 100] or an unknown `method`."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q!r}")
    if not values:
        return math.nan
    ordered = sorted(values)
    if method == "nearest_rank":
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100.0 * len(ordered)) - 1))]
    if method == "linear":
        position = (len(ordered) - 1) * q / 100.0
        below = math.floor(position)
        above = min(below + 1, len(ordered) - 1)
        return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
    raise ValueError(f"unknown method {method!r}")


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; NaN when there are no values."""
    return sum(values) / len(values) if values else math.nan
