"""The PromQL reader of the deploy tests (tests/deploy/promql.py): what it finds in each kind of expression the
dashboard and the rules use, and that it refuses what it cannot read."""

from __future__ import annotations

import pytest

from tests.deploy.promql import Matcher, Selector, literal_alternatives, parse


@pytest.mark.parametrize(
    ("expr", "selectors", "grouping"),
    [
        ("rolloutgate_queue_depth", [Selector("rolloutgate_queue_depth")], set()),
        (
            'sum by (state) (rolloutgate_engine_state{instance=~"$instance"})',
            [Selector("rolloutgate_engine_state", (Matcher("instance", "=~", "$instance"),))],
            {"state"},
        ),
        (
            'sum by (clock) (rate(rolloutgate_clock_seconds_sum{clock=~"queue|charged", a!="x"}[$__rate_interval]))',
            [
                Selector(
                    "rolloutgate_clock_seconds_sum",
                    (Matcher("clock", "=~", "queue|charged"), Matcher("a", "!=", "x")),
                )
            ],
            {"clock"},
        ),
        (
            "sum(rate(a_total[5m])) by (engine) / ignoring (kind) group_left sum(rate(b_total[1h:1m] offset 5m))",
            [Selector("a_total"), Selector("b_total")],
            {"engine", "kind"},
        ),
        (
            'count by (job, instance) (q) unless on (job, instance) (s{state="healthy"} == 1)',
            [Selector("q"), Selector("s", (Matcher("state", "=", "healthy"),))],
            {"job", "instance"},
        ),
        (
            "histogram_quantile(0.99, sum without (engine) (rate(h_bucket{le!~'x\\'y'}[5m]))) * 60 > bool 1e3",
            [Selector("h_bucket", (Matcher("le", "!~", "x'y"),))],
            {"engine"},
        ),
        (
            "max(x{a=`raw\\s`}) >= 0.25 and y",
            [Selector("x", (Matcher("a", "=", "raw\\s"),)), Selector("y")],
            set(),
        ),
    ],
)
def test_selectors_and_grouping_labels(expr: str, selectors: list[Selector], grouping: set[str]) -> None:
    parsed = parse(expr)
    assert list(parsed.selectors) == selectors
    assert parsed.grouping == grouping


@pytest.mark.parametrize(
    "expr",
    [
        '{__name__=~"rolloutgate_.+"}',  # no metric name to check
        "x{a=1}",  # a matcher needs a string
        "x{a}",
        "sum by (a 1) (x)",
        "x # a comment",
    ],
)
def test_what_it_cannot_read_raises(expr: str) -> None:
    with pytest.raises((ValueError, IndexError)):
        parse(expr)


def test_literal_alternatives_only_for_plain_lists() -> None:
    assert literal_alternatives("queue|paused|contention") == ["queue", "paused", "contention"]
    assert literal_alternatives("healthy") == ["healthy"]
    assert literal_alternatives(".+") is None
    assert literal_alternatives("$instance") is None
    assert literal_alternatives("a.*|b") is None
