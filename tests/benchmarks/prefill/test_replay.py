"""Prefill-aware admission off and on in the incident replay (benchmarks/prefill/replay.py).

The figures are checked on hand-made replay records (every number known in advance); one short real run, a
scaled-down incident (small histories, 2 engines, 120 simulated seconds in ~15 s), checks the wiring: both
modes run on the same seed, their engines' token times reach the records, and every figure comes out.
The long comparison itself is `make prefill-compare`, not part of `make test`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks.prefill.measure import table
from benchmarks.prefill.replay import ROWS, compare, measure, pool_runs, prefill_config
from rolloutreplay.scenario import ReplayConfig

pytestmark = pytest.mark.filterwarnings(
    "ignore:coroutine 'OpenAIChatCompletion.acompletion' was never awaited:RuntimeWarning"
)

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _generation(
    engine: int, rid: str, submitted: float, first: float, finished: float | None, rate: float, end: float
) -> dict[str, Any]:
    last = end if finished is None else finished
    times = [first + i / rate for i in range(round((last - first) * rate) + 1)]
    return {
        "engine": engine,
        "rid": rid,
        "prompt_tokens": 20_000,
        "cached_tokens": 0,
        "completion_tokens": len(times),
        "submitted_at": submitted,
        "started_at": submitted,
        "first_token_at": first,
        "finished_at": finished,
        "finish": None if finished is None else "length",
        "message": None,
        "num_retractions": 0,
        "written": False,
        "token_times": times,
    }


def _turn(tag: str, agent: str, kind: str, started: float, ended: float) -> dict[str, Any]:
    return {
        "tag": tag,
        "agent": agent,
        "session": tag.rsplit("-", 1)[0],
        "turn": 0,
        "kind": kind,
        "max_tokens": 1000,
        "prompt_tokens": 20_000,
        "started_at": started,
        "ended_at": ended,
        "ok": True,
        "error": None,
        "message": None,
        "completion_tokens": 1000,
    }


def _attempt(tag: str, request_id: str, arrived: float, ended: float) -> dict[str, Any]:
    return {
        "tag": tag,
        "retry_count": 0,
        "arrived_at": arrived,
        "path": "/v1/chat/completions",
        "request_id": request_id,
        "ended_at": ended,
        "status": 200,
        "client_gone": False,
    }


def _end(request_id: str, at: float, engine: int, contention_s: float) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "at": at,
        "ok": True,
        "code": "ok",
        "status": 200,
        "engine_url": URLS[engine],
        "timing": {"contention_s": contention_s},
    }


def _records(prefill_admission: bool) -> dict[str, Any]:
    """400 s on 2 engines: a storm of one session at 100 s (its first token at 150 s), engine 1 frozen at
    300 s (caught by the gateway at 360 s). Three turns: a00 decodes on engine 0 at 10 tok/s through the storm;
    a01 decodes on engine 1 at 4 tok/s, is caught by the freeze and answered by engine 0; the storm's session
    runs on engine 0."""
    end = 400.0
    config = ReplayConfig(engines=2, agents=2, storm_sessions=1, prefill_admission=prefill_admission)
    return {
        "mode": "engine",
        "config": config.to_json(),
        "engine_urls": URLS,
        "events": [
            {"kind": "storm", "planned_at": 100.0, "sessions": 1, "wave": 0, "at": 100.0, "ended_at": 100.0},
            {"kind": "freeze", "planned_at": 300.0, "engine": 1, "at": 300.0, "ended_at": 300.0},
        ],
        "turns": [
            _turn("a00-s0-t0", "a00", "opening", 0.0, 250.0),
            _turn("storm0-0-s0-t0", "storm0-0", "storm", 100.0, 220.0),
            _turn("a01-s0-t0", "a01", "medium", 50.0, 380.0),
        ],
        "attempts": [
            _attempt("a00-s0-t0", "g1", 0.0, 250.0),
            _attempt("storm0-0-s0-t0", "g2", 100.0, 220.0),
            _attempt("a01-s0-t0", "g3", 50.0, 380.0),
        ],
        "ends": [_end("g1", 250.0, 0, 0.0), _end("g2", 220.0, 0, 30.0), _end("g3", 380.0, 0, 12.5)],
        "marks": [{"at": 360.0, "engine_url": URLS[1], "state": "quarantined", "detail": "stall"}],
        "generations": [
            _generation(0, "g1-0", 0.0, 10.0, 250.0, rate=10.0, end=end),
            _generation(0, "g2-0", 100.0, 150.0, 220.0, rate=10.0, end=end),
            _generation(1, "g3-0", 50.0, 60.0, None, rate=4.0, end=300.0),  # frozen: no token after 300 s
            _generation(0, "g3-1", 330.0, 335.0, 380.0, rate=10.0, end=end),
        ],
        "holds": [{"engine": 1, "reason": "freeze", "start_at": 300.0, "end_at": None}],
        "ended_at": end,
        "real_s": 16.7,
        "cpu_s": 10.0,
        "loop_lags": [[120.0, 0.2]],
    }


def test_one_runs_figures_from_its_records() -> None:
    records = _records(prefill_admission=True)
    f = measure(records)
    assert f["mode"] == "on" and f["seed"] == 0
    # the storm spans 100-150 s; a00 and a01 decode through it (the storm's own first token is at its end)
    assert f["storm_span_s"] == [50.0]
    assert f["colocated_decode_rate_mean"] == pytest.approx((10.0 + 4.0) / 2)
    assert f["colocated_decode_rate_pooled"] == pytest.approx((500 + 200) / 100)
    tokens = sum(g["completion_tokens"] for g in records["generations"])
    assert f["tokens_per_s"] == pytest.approx(tokens / 400.0)
    assert f["turn_latency_p99_s"] == pytest.approx(330.0)  # a01, run again after the freeze
    assert f["turn_latency_p99_unfrozen_s"] == pytest.approx(250.0)
    assert f["turns_caught_by_freeze"] == 1
    assert f["turns_completed"] == 3 and f["turns_failed"] == 0
    assert f["uncharged_contention_s"] == pytest.approx(42.5)
    # the replay's own engine-time verdicts: detected 60 s after the freeze, its request answered elsewhere
    assert [v["ok"] for v in f["verdicts"]] == [True, True, True, True]
    assert f["verdicts_ok"] == 1
    assert f["loop_stall_max_real_s"] == pytest.approx(0.2) and f["is_disturbed"] == 0


def test_time_the_frozen_engine_stood_still_is_not_a_slow_decode() -> None:
    records = _records(prefill_admission=False)
    records["events"][0].update(at=280.0, planned_at=280.0)  # a storm whose span runs into the freeze
    records["generations"][1].update(submitted_at=280.0, started_at=280.0, first_token_at=320.0)
    f = measure(records)
    assert f["mode"] == "off"
    # a00 ended at 250 s; a01 decodes 280-300 s then stands still (not counted), its retry on engine 0 has
    # its first token at 335 s, after the span
    assert f["colocated_decode_rate_mean"] == pytest.approx(4.0)
    assert f["colocated_decode_rate_pooled"] == pytest.approx(80 / 20)


def test_records_without_token_times_are_refused() -> None:
    records = _records(prefill_admission=True)
    for g in records["generations"]:
        del g["token_times"]
    with pytest.raises(ValueError, match="token times"):
        measure(records)


def test_pooled_runs_count_verdicts_and_keep_the_worst_stall() -> None:
    runs = [measure(_records(prefill_admission=True)) for _ in range(2)]
    runs[1]["verdicts_ok"] = 0
    runs[1]["loop_stall_max_real_s"] = 1.5
    pooled = pool_runs(runs)
    assert pooled["verdicts_held"] == "1 of 2"
    assert pooled["loop_stall_max_real_s"] == 1.5
    assert pooled["turns_caught_by_freeze"] == 2
    assert pooled["turn_latency_p99_s"] == pytest.approx(330.0)
    assert pooled["seeds"] == [0, 0]


def test_each_run_is_the_same_replay_but_for_admission() -> None:
    base = ReplayConfig(agents=5)
    off, on = prefill_config(base, 3, "off"), prefill_config(base, 3, "on")
    assert (off.seed, off.prefill_admission, off.record_token_times) == (3, False, True)
    assert (on.seed, on.prefill_admission, on.record_token_times) == (3, True, True)
    assert off.agents == on.agents == 5
    with pytest.raises(ValueError):
        prefill_config(base, 0, "maybe")


TINY = ReplayConfig(
    time_scale=8.0,
    agents=3,
    engines=2,
    duration_s=120.0,
    client_timeout_s=60.0,
    stall_timeout_s=25.0,
    history_tokens=(10_000, 14_000),
    opening_tokens=(200, 400),
    medium_tokens=(500, 900),
    long_tokens=(1_500, 2_000),
    turns_per_session=3,
    tool_tokens=200,
    reply_kept_tokens=200,
    tool_time_s=(1.0, 3.0),
    start_spread_s=5.0,
    storm_sessions=3,
    storm_tokens=(200, 300),
    storms_at=(0.2, 0.5),
    update_at=0.35,
    freeze_at=0.7,
)


@pytest.mark.timeout(120)
async def test_a_short_real_comparison_records_token_times_and_measures_both_modes(tmp_path: Path) -> None:
    per_mode = await compare(TINY, [1], tmp_path, in_process=True, log=lambda _: None)
    assert [len(per_mode[m]) for m in ("off", "on")] == [1, 1]
    for mode in ("off", "on"):
        f = per_mode[mode][0]
        assert f["mode"] == mode and f["seed"] == 1
        assert f["turns_completed"] > 0
        assert f["colocated_generations"] > 0 and math.isfinite(f["colocated_decode_rate_mean"])
        assert f["tokens_per_s"] > 0
        records = orjson.loads((tmp_path / f"records-seed1-{mode}.json").read_bytes())
        assert records["config"]["prefill_admission"] is (mode == "on")
        assert records["config"]["seed"] == 1
        finished = [g for g in records["generations"] if g["finish"] == "length"]
        assert finished and all(len(g["token_times"]) == g["completion_tokens"] for g in finished)
    text = table({m: pool_runs(per_mode[m]) for m in ("off", "on")}, ROWS)
    assert text.splitlines()[0] == "| | off | on | on vs off |"
    assert len(text.splitlines()) == 2 + len(ROWS)
