"""The RL-shape benchmark (`make bench-rl`, benchmarks/perf/rl_shape/): the load plan, the ratio and verdict
arithmetic with small numbers, and its quick mode end to end (direct and through rolloutgate).

No timing or verdict assertions on the real run: these check that the harness measures and reports.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.kit.stats import percentile
from benchmarks.perf.rl_shape import plan as shape
from benchmarks.perf.rl_shape.phase import PhaseResult, Sample, TurnResult
from benchmarks.perf.rl_shape.plan import (
    QUICK,
    ShapeOptions,
    draw_max_new,
    plan_load,
    request_body,
    session_prefix,
    turn_new_ids,
)
from benchmarks.perf.rl_shape.render import render
from benchmarks.perf.rl_shape.run import run_shape
from benchmarks.perf.rl_shape.verdict import goals, verdict


def test_max_new_is_bounded_and_skewed_to_the_short_end() -> None:
    rng = random.Random(1)
    draws = [draw_max_new(rng, 2048, 32768) for _ in range(20_000)]
    assert min(draws) >= 2048 and max(draws) <= 32768
    # density ~ 1/x^2 on [a, b]: median 2ab / (a + b) = 3,855, mean ab ln(b/a) / (b - a) = 6,056
    assert percentile(draws, 50) == pytest.approx(2 * 2048 * 32768 / (2048 + 32768), rel=0.05)
    assert sum(draws) / len(draws) == pytest.approx(2048 * 32768 * math.log(16) / (32768 - 2048), rel=0.05)
    assert sum(d > 16384 for d in draws) / len(draws) < 0.1


def test_the_plan_is_fixed_by_the_seed_and_prefix_shared_within_sessions() -> None:
    options = replace(ShapeOptions(), engines=2, running_per_engine=4, tokens_per_worker=40_000)
    plan = plan_load(options)
    assert plan == plan_load(options)
    assert plan != plan_load(replace(options, seed=1))
    assert len(plan) == options.concurrency == 8
    low, high = options.max_new
    for worker, turns in enumerate(plan):
        spent = sum(t.max_new for t in turns)
        assert options.tokens_per_worker - low < spent <= options.tokens_per_worker
        assert [t.index for t in turns] == list(range(len(turns)))
        for turn in turns:
            assert turn.worker == worker and turn.session_number % options.concurrency == worker
            assert options.input_min <= turn.input_len <= options.input_max
            assert turn.max_new <= high and (turn.max_new >= low or turn is turns[-1])
        for previous, turn in itertools.pairwise(turns):
            if turn.session == previous.session:
                assert turn.turn_in_session == previous.turn_in_session + 1
                assert turn.input_len == previous.input_len + previous.max_new + turn.new_ids
                assert options.new_ids[0] <= turn.new_ids <= options.new_ids[1]
            else:
                assert turn.turn_in_session == 0 and turn.new_ids == 0
                # a session ends only when its next input would pass input_max
                assert previous.input_len + previous.max_new + options.new_ids[1] > options.input_max
    sessions = [t.session for turns in plan for t in turns if t.turn_in_session == 0]
    assert len(sessions) == len(set(sessions))


def test_ids_are_valid_deterministic_and_share_only_the_system_prefix() -> None:
    a, b = session_prefix(0, 3000), session_prefix(1, 3000)
    assert len(a) == 3000 and a == session_prefix(0, 3000)
    assert all(shape.FIRST_ID <= t < shape.VOCAB_SIZE for t in a + b)
    shared = shape.SYSTEM_PREFIX_TOKENS
    assert a[:shared] == b[:shared] and a[shared:] != b[shared:]
    turn = plan_load(replace(QUICK, tokens_per_worker=10_000))[0][1]
    assert len(turn_new_ids(turn)) == turn.new_ids
    assert turn_new_ids(turn) == turn_new_ids(turn)


def test_the_body_is_miles_tito_call() -> None:
    body = request_body([5, 6, 7], 2048)
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 2048 and params["no_stop_trim"] is True
    assert params["skip_special_tokens"] is False and params["spaces_between_special_tokens"] is False
    assert "stream" not in body


def _phase(name: str, **overrides: Any) -> PhaseResult:
    results = [TurnResult(0, i, 200, latency_s=1.0 + i, completion_tokens=1000) for i in range(4)]
    phase = PhaseResult(
        name=name,
        wall_s=10.0,
        turns_planned=4,
        results=results,
        cut=False,
        engine={"output_bytes": 4000.0, "output_chunks": 4.0, "generated_tokens": 4000.0},
        engine_requests=[2, 2],
        work_source="sim:output_bytes_total",
        gateway_cpu_s=None if name == "direct" else 0.4,
        sim_cpu_s=5.0,
        client_cpu_s=1.0,
        idle_rss=None if name == "direct" else 100,
        samples=[Sample(0.25, 4, 1000, 1100), Sample(0.5, 4, 2000, 3100), Sample(0.75, 3, 1500, 3400)],
    )
    for key, value in overrides.items():
        setattr(phase, key, value)
    return phase


def test_phase_arithmetic() -> None:
    phase = _phase("rolloutgate")
    assert phase.bytes_per_request == 1000 and phase.chunks_per_request == 1 and phase.bytes_per_token == 1
    assert phase.generated_tokens == 4000
    assert phase.cpu_per_million_tokens == pytest.approx(100.0)  # 0.4 CPU-s for 4,000 tokens
    assert phase.peak == Sample(0.5, 4, 2000, 3100)  # the most body bytes in flight
    assert phase.rss_per_body == pytest.approx((3100 - 100) / 2000)
    assert phase.max_rss == 3400
    assert phase.p(50) == pytest.approx(2.5) and phase.p(99) == pytest.approx(3.97)
    assert _phase("direct").rss_per_body is None
    assert percentile([], 50) != percentile([], 50)  # nan


def test_goals_ratios_and_verdicts_with_small_numbers() -> None:
    direct = _phase("direct")
    mine = _phase(
        "rolloutgate", engine={"output_bytes": 4200.0, "output_chunks": 8.0, "generated_tokens": 4000.0}
    )
    router = _phase("sglang-router", gateway_cpu_s=0.8, idle_rss=2000)
    mine.results = [replace(r, latency_s=r.latency_s * 1.005) for r in mine.results]
    router.results = [replace(r, latency_s=r.latency_s * 1.02) for r in router.results]
    rows = {row["goal"]: row for row in goals({p.name: p.summary() for p in (direct, mine, router)})}

    def row(prefix: str) -> dict[str, Any]:
        (match,) = [r for goal, r in rows.items() if goal.startswith(prefix)]
        return match

    assert row("engine output bytes per request via rolloutgate")["value"] == pytest.approx(1.05)
    assert row("engine output bytes per request via rolloutgate")["verdict"] == "met"
    # 2 chunks a request against 1: within 1.1x + 1 (the first-token chunk)
    assert row("engine output chunks per request via rolloutgate")["value"] == pytest.approx(2.0)
    assert row("engine output chunks per request via rolloutgate")["verdict"] == "met"
    assert row("engine output bytes per request via sglang-router")["value"] == pytest.approx(1.0)
    cpu = row("rolloutgate CPU-s per M generated tokens")
    assert cpu["value"] == pytest.approx(0.5) and cpu["verdict"] == "met"
    assert (
        row("rolloutgate (RSS")["value"] == pytest.approx(1.5) and row("rolloutgate (RSS")["verdict"] == "met"
    )
    assert row("sglang-router (RSS")["value"] == pytest.approx(0.55)
    assert row("added turn latency via rolloutgate over direct, p50")["value"] == pytest.approx(0.5)
    assert row("added turn latency via rolloutgate over direct, p50")["verdict"] == "met"
    assert row("added turn latency via sglang-router over direct, p99")["value"] == pytest.approx(2.0)
    assert row("added turn latency via sglang-router over direct, p99")["verdict"] == "NOT met"


def test_output_work_past_the_allowance_is_not_met() -> None:
    direct = _phase("direct")
    mine = _phase(
        "rolloutgate", engine={"output_bytes": 4000.0, "output_chunks": 12.0, "generated_tokens": 4000.0}
    )
    rows = goals({"direct": direct.summary(), "rolloutgate": mine.summary()})
    (chunks,) = [r for r in rows if r["goal"].startswith("engine output chunks")]
    assert chunks["value"] == pytest.approx(3.0) and chunks["verdict"] == "NOT met"  # 3 > 1.1 x 1 + 1


def test_a_cut_phase_is_judged_per_generated_token() -> None:
    direct = _phase("direct")
    mine = _phase(
        "rolloutgate",
        cut=True,
        engine={"output_bytes": 3000.0, "output_chunks": 3.0, "generated_tokens": 2000.0},
    )
    mine.results = mine.results[:2]
    (work,) = [
        r for r in goals({"direct": direct.summary(), "rolloutgate": mine.summary()}) if "bytes" in r["goal"]
    ]
    assert work["value"] == pytest.approx(1.5)  # 1.5 bytes per token against 1.0
    assert "cut" in work["measured"] and work["verdict"] == "NOT met"
    assert verdict(None, 1.0) == "not measured"


@pytest.mark.timeout(120)
def test_the_quick_mode_runs_direct_and_through_rolloutgate(tmp_path: Path) -> None:
    options = replace(QUICK, paths=("direct", "rolloutgate"))
    result = run_shape(options, out_dir=tmp_path, server_cpu=None, client_cpu=None, log=lambda _m: None)
    saved = json.loads(Path(result["meta"]["json"]).read_text())
    assert set(saved["phases"]) == {"direct", "rolloutgate"}
    for phase in saved["phases"].values():
        assert phase["turns_ok"] == phase["turns_planned"] == saved["plan"]["turns"]
        assert phase["failed"] == 0 and not phase["phase_cut_at_cap"]
        assert phase["output_bytes_per_request"] > 0 and phase["latency_p50_s"] > 0
    mine = saved["phases"]["rolloutgate"]
    assert mine["gateway_cpu_s_per_million_tokens"] > 0 and mine["peak"]["in_flight"] > 0
    assert {row["verdict"] for row in saved["goals"]} <= {"met", "NOT met", "not measured"}
    assert any("via rolloutgate over direct" in row["goal"] for row in saved["goals"])
    report = render(result)
    assert "| goal | measured | verdict |" in report and "| rolloutgate |" in report
