"""The shared figures of prefill-aware admission (benchmarks/prefill/measure.py), on hand-made generations."""

from __future__ import annotations

import math

import pytest

from benchmarks.kit.stats import percentile
from benchmarks.prefill.measure import (
    Generation,
    decode_during_storms,
    last_attempts,
    parse_seeds,
    pool,
    split_rid,
    storm_span_end,
    table,
)


def _steady(engine: int, rid: str, start: float, end: float, rate: float) -> Generation:
    """A generation with its first token at `start`, then `rate` tokens per second until `end`."""
    count = round((end - start) * rate)
    return Generation(
        engine=engine,
        rid=rid,
        first_token_at=start,
        ended_at=end,
        token_times=[start + i / rate for i in range(count + 1)],
    )


def test_a_storm_ends_at_the_last_first_token_of_its_sessions_or_at_the_end_of_the_run() -> None:
    assert storm_span_end([110.0, 150.0, 130.0], expected=3, run_end=1000.0) == 150.0
    assert storm_span_end([110.0, None, 130.0], expected=3, run_end=1000.0) == 1000.0  # one never started
    assert storm_span_end([110.0, 130.0], expected=3, run_end=1000.0) == 1000.0  # one never dispatched


def test_the_decode_rate_counts_each_generation_within_the_span_from_its_first_token() -> None:
    slow = _steady(0, "r1-0", 0.0, 300.0, rate=5.0)  # decoding through the whole span at 5 tok/s
    late = _steady(1, "r2-0", 150.0, 300.0, rate=20.0)  # first token inside the span: counts from then on
    brief = _steady(1, "r3-0", 197.0, 300.0, rate=50.0)  # 3 s inside the span: too short for a rate
    after = _steady(2, "r4-0", 250.0, 300.0, rate=50.0)  # starts after the span: not co-located
    none = Generation(engine=3, rid="r5-0", first_token_at=None, ended_at=300.0)  # never had a token
    decode = decode_during_storms([(100.0, 200.0)], [slow, late, brief, after, none])
    assert decode.rates == pytest.approx([5.0, 20.0])
    assert decode.time_in == pytest.approx(150.0)
    assert decode.tokens_in == 500 + 1000
    assert decode.mean == pytest.approx(12.5)
    assert decode.pooled == pytest.approx(1500 / 150)


def test_time_an_engine_was_held_does_not_count_and_each_span_counts_apart() -> None:
    # decodes at 10 tok/s, frozen from 150 s on: its time in the span is the 50 s it worked
    frozen = Generation(
        engine=1,
        rid="r1-0",
        first_token_at=0.0,
        ended_at=400.0,
        token_times=[i / 10 for i in range(1501)],
    )
    decode = decode_during_storms([(100.0, 200.0), (300.0, 350.0)], [frozen], held={1: [(150.0, 400.0)]})
    assert decode.rates == pytest.approx([10.0])  # the second span falls wholly in the freeze
    assert decode.time_in == pytest.approx(50.0)
    empty = decode_during_storms([], [frozen])
    assert empty.rates == [] and math.isnan(empty.mean) and math.isnan(empty.pooled)


def test_a_requests_last_attempt_is_its_highest_numbered_one_wherever_it_ran() -> None:
    a0 = Generation(engine=3, rid="req-a-0", first_token_at=10.0, ended_at=50.0)
    a1 = Generation(engine=0, rid="req-a-1", first_token_at=90.0, ended_at=120.0)
    b = Generation(engine=1, rid="req-b-0", first_token_at=5.0, ended_at=9.0)
    assert last_attempts([a1, b, a0]) == {"req-a": a1, "req-b": b}
    assert split_rid("abc-def-12") == ("abc-def", 12)
    assert split_rid("plain") == ("plain", 0)


def _figures(mode: str, latencies: list[float], rates: list[float], tokens_per_s: float) -> dict[str, object]:
    return {
        "mode": mode,
        "tokens_per_s": tokens_per_s,
        "turn_latency_p50_s": percentile(latencies, 50),
        "turn_latency_p99_s": percentile(latencies, 99),
        "colocated_decode_rate_mean": sum(rates) / len(rates),
        "colocated_decode_rate_pooled": 0.0,
        "turns_completed": len(latencies),
        "turns_failed": 1,
        "storm_span_s": [100.0, 200.0],
        "raw": {
            "rates": rates,
            "tokens_in": 10.0 * len(rates),
            "time_in": 2.0 * len(rates),
            "latencies": latencies,
        },
    }


def test_pooled_runs_take_percentiles_over_all_turns_and_average_the_rest() -> None:
    first = _figures("on", [float(v) for v in range(1, 51)], [10.0], tokens_per_s=500.0)
    second = _figures("on", [float(v) for v in range(51, 101)], [20.0, 30.0], tokens_per_s=520.0)
    pooled = pool([first, second])
    assert pooled["turn_latency_p99_s"] == 99.0  # over the 100 turns, not a mean of per-run p99s
    assert pooled["turn_latency_p50_s"] == 50.0
    assert pooled["colocated_decode_rate_mean"] == pytest.approx(20.0)  # over the 3 generations
    assert pooled["colocated_decode_rate_pooled"] == pytest.approx(5.0)
    assert pooled["tokens_per_s"] == pytest.approx(510.0)
    assert pooled["turns_completed"] == 100 and pooled["turns_failed"] == 2
    assert pooled["storm_span_s"] == [100.0, 200.0]
    assert pooled["runs"] == 2
    assert pool([first]) == first


def test_the_table_shows_each_mode_and_the_change_of_its_float_figures() -> None:
    off = _figures("off", [100.0, 200.0], [5.0], tokens_per_s=500.0) | {"caught": 3, "stall_s": 0.5}
    on = _figures("on", [100.0, 150.0], [10.0], tokens_per_s=490.0) | {"caught": 2, "stall_s": 0.25}
    text = table(
        {"on": on, "off": off},
        [
            ("decode", "colocated_decode_rate_mean", "{:.1f}"),
            ("tokens", "tokens_per_s", "{:.1f}"),
            ("turns", None, ""),
            ("spans", "storm_span_s", "{:.0f}"),
            ("caught", "caught", "{:d}"),
            ("stall", "stall_s", "{:.2f}"),
        ],
        without_change=("stall_s",),
    )
    lines = text.splitlines()
    assert lines[0] == "| | off | on | on vs off |"
    assert lines[2] == "| decode | 5.0 | 10.0 | +100.0% |"
    assert lines[3] == "| tokens | 500.0 | 490.0 | -2.0% |"
    assert lines[4] == "| turns | 2 / 1 | 2 / 1 |  |"
    assert lines[5] == "| spans | 100, 200 | 100, 200 |  |"
    assert lines[6] == "| caught | 3 | 2 |  |"  # a count: no relative change
    assert lines[7] == "| stall | 0.50 | 0.25 |  |"
    assert table({"on": on}, [("tokens", "tokens_per_s", "{:.1f}")]).splitlines()[2] == "| tokens | 490.0 |"


def test_parse_seeds() -> None:
    assert parse_seeds("0-3,7") == [0, 1, 2, 3, 7]
    assert parse_seeds("5") == [5]
