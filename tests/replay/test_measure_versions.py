"""The replay's weight figures (rolloutreplay/measure.py `version_figures`), on hand-built engine records: tokens
generated under a version older than the fleet's newest at that moment (served: in a delivered answer), and
generations that reached an engine while it was half-updated (mid-update, the fleet's update under way and not
yet on it, or behind the fleet after a failed update or a restart onto its launch weights)."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutreplay.measure import FleetWeights, measure, version_figures, view_generations
from rolloutreplay.report import markdown_report
from rolloutreplay.result import ReplayResult
from rolloutreplay.scenario import ReplayConfig
from tests.replay.mode_records import mode_records

# 3 engines on `default`; the update to v2 runs on engine 1 from 100 s and on engine 2 from 105 s, both take it
# at 125 s; engine 0's fails (100-125 s); engine 1 restarts at 200 s onto its launch weights
WEIGHTS = [
    {
        "engine": 0,
        "versions": [{"engine": 0, "at": 0.0, "version": "default", "cause": "launch"}],
        "updates": [{"engine": 0, "begun_at": 100.0, "ended_at": 125.0, "target": "v2", "ok": False}],
    },
    {
        "engine": 1,
        "versions": [
            {"engine": 1, "at": 0.0, "version": "default", "cause": "launch"},
            {"engine": 1, "at": 125.0, "version": "v2", "cause": "update"},
            {"engine": 1, "at": 200.0, "version": "default", "cause": "restart"},
        ],
        "updates": [{"engine": 1, "begun_at": 100.0, "ended_at": 125.0, "target": "v2", "ok": True}],
    },
    {
        "engine": 2,
        "versions": [
            {"engine": 2, "at": 0.0, "version": "default", "cause": "launch"},
            {"engine": 2, "at": 125.0, "version": "v2", "cause": "update"},
        ],
        "updates": [{"engine": 2, "begun_at": 105.0, "ended_at": 125.0, "target": "v2", "ok": True}],
    },
]


def generation(
    rid: str,
    engine: int,
    *,
    arrived: float,
    submitted: float | None = None,
    finished: float,
    tokens: int,
    spans: list[list[Any]],
    marks: list[list[float]] | None = None,
    finish: str = "length",
    message: str | None = None,
) -> dict[str, Any]:
    submitted = arrived if submitted is None else submitted
    return {
        "engine": engine,
        "rid": f"{rid}-01",
        "prompt_tokens": 1_000,
        "cached_tokens": 0,
        "completion_tokens": tokens,
        "submitted_at": submitted,
        "started_at": submitted,
        "first_token_at": submitted + 1.0,
        "finished_at": finished,
        "finish": finish,
        "message": message,
        "num_retractions": 0,
        "written": False,
        "arrived_at": arrived,
        "weight_spans": spans,
        "token_marks": marks or [],
    }


GENERATIONS = [
    # engine 0, running across its failed update: 400 tokens before the fleet moved to v2 at 125 s, 600 on
    # `default` after it (300 while engine 1 held v2, 300 after its restart: engine 2 still held v2); delivered
    generation(
        "a",
        0,
        arrived=50.0,
        finished=300.0,
        tokens=1_000,
        spans=[["default", 0]],
        marks=[[125.0, 400], [200.0, 700]],
    ),
    # engine 1, crossed its own update in place: 400 on `default` while the fleet had nothing newer, 500 on v2
    generation(
        "b",
        1,
        arrived=50.0,
        finished=180.0,
        tokens=900,
        spans=[["default", 0], ["v2", 400]],
        marks=[[125.0, 400]],
    ),
    # engine 1 after its restart onto `default`: behind; its 300 tokens forbidden; nobody received them
    generation("c", 1, arrived=210.0, finished=260.0, tokens=300, spans=[["default", 0]]),
    # engine 2 mid-update (it waited behind the pause until 125 s): generated on v2
    generation("d", 2, arrived=110.0, submitted=125.0, finished=150.0, tokens=200, spans=[["v2", 0]]),
    # engine 0 after its update failed: behind
    generation("e", 0, arrived=130.0, finished=160.0, tokens=100, spans=[["default", 0]]),
    # engine 2 before anything of the update: fine
    generation("f", 2, arrived=90.0, finished=95.0, tokens=50, spans=[["default", 0]]),
    # engine 2 while engine 1's update ran and its own had not begun: the fleet's update pending there
    generation("g", 2, arrived=102.0, submitted=125.0, finished=140.0, tokens=50, spans=[["v2", 0]]),
    # engine 1's generation its restart ended: lost to the fault, not wasted
    generation(
        "h",
        1,
        arrived=150.0,
        finished=200.0,
        tokens=500,
        spans=[["v2", 0]],
        finish="abort",
        message="engine crashed",
    ),
]
ANSWERED = ("a", "b", "d", "e", "f", "g")


def attempt(rid: str) -> dict[str, Any]:
    return {
        "tag": f"t-{rid}",
        "request_id": rid,
        "arrived_at": 0.0,
        "ended_at": 310.0,
        "client_gone": False,
        "status": 200,
    }


def records(*, weights: list[dict[str, Any]] | None = WEIGHTS) -> dict[str, Any]:
    ends = [
        {
            "request_id": r,
            "at": 305.0,
            "ok": True,
            "code": "ok",
            "status": 200,
            "engine_url": None,
            "timing": None,
        }
        for r in ANSWERED
    ]
    config = ReplayConfig(engines=3, version_faults=True, freeze_engine=2, restart_engine=1)
    return mode_records(
        config,
        3,
        attempts=[attempt(r) for r in ANSWERED],
        ends=ends,
        generations=GENERATIONS,
        ended_at=400.0,
        real_s=20.0,
        cpu_s=10.0,
        **({} if weights is None else {"weights": weights}),
    )


def test_the_fleets_newest_version_and_each_engines_state_over_time() -> None:
    fleet = FleetWeights(WEIGHTS)
    assert fleet.rank == {"default": 0, "v2": 1}
    assert (
        fleet.held(1, 124.9) == "default"
        and fleet.held(1, 125.0) == "v2"
        and fleet.held(1, 200.0) == "default"
    )
    assert [fleet.newest(t) for t in (0.0, 124.9, 125.0, 250.0)] == [0, 0, 1, 1]
    assert not fleet.is_forbidden("default", 124.9) and fleet.is_forbidden("default", 125.0)
    assert fleet.half_updated(0, 90.0) is None
    assert fleet.half_updated(0, 100.0) == "mid_update"
    assert fleet.half_updated(2, 102.0) == "update_pending"
    assert fleet.half_updated(0, 125.0) == "behind"  # its update failed: the fleet moved on without it
    assert fleet.half_updated(2, 125.0) is None
    assert fleet.half_updated(1, 199.0) is None and fleet.half_updated(1, 200.0) == "behind"


def test_tokens_under_a_forbidden_version_and_dispatches_to_half_updated_engines() -> None:
    data = records()
    views, _ = view_generations(data)
    figures = version_figures(data, views)
    assert figures["versions"] == ["default", "v2"]
    assert figures["forbidden_tokens_generated"] == 600 + 300 + 100
    assert figures["forbidden_tokens_served"] == 600 + 100  # c's 300 reached nobody
    by_rid = {g["rid"]: g["tokens"] for g in figures["forbidden_generations"]}
    assert by_rid == {"a-01": 600, "c-01": 300, "e-01": 100}
    assert figures["half_updated_dispatches"] == 4
    assert figures["half_updated_by_reason"] == {"behind": 2, "mid_update": 1, "update_pending": 1}
    assert {(d["rid"], d["reason"]) for d in figures["half_updated_list"]} == {
        ("c-01", "behind"),
        ("d-01", "mid_update"),
        ("e-01", "behind"),
        ("g-01", "update_pending"),
    }


def test_the_report_and_the_verdicts_carry_them() -> None:
    data = records()
    figures = measure(data)
    assert figures["weights"]["forbidden_tokens_served"] == 700
    # the generation the restart ended is lost to the fault, not wasted
    assert figures["wasted_engine_seconds"] == 50.0  # c's, nobody received it
    assert figures["lost_to_fault_engine_seconds"] == 50.0
    config = ReplayConfig.from_json(data["config"])
    result = ReplayResult(config, {"engine": figures}, {})
    text = markdown_report(result)
    assert "| 700 / 1,000 |" in text
    assert "| 4 (1 mid-update, 1 update pending, 2 behind) |" in text
    claims = {v["claim"]: v for v in result.verdicts}
    served = claims["0 tokens served under a version the policy (latest-only) forbids"]
    dispatched = claims["0 requests dispatched to a half-updated engine"]
    assert (served["ok"], served["measured"]) == (False, 700)
    assert (dispatched["ok"], dispatched["measured"]) == (False, 4)


def test_records_without_the_engines_weights_give_zeros() -> None:
    figures = measure(records(weights=None))["weights"]
    assert figures["forbidden_tokens_generated"] == 0 and figures["half_updated_dispatches"] == 0


def test_version_faults_in_the_scenario_and_the_gateways_settings() -> None:
    from rolloutreplay.scenario import timeline
    from rolloutreplay.world import gateway_settings

    config = ReplayConfig(engines=4, duration_s=1000.0, version_faults=True)
    events = {e.kind: e for e in timeline(config)}
    assert events["update"].detail == {"fail_engine": 0}
    assert events["restart"].at_s == 550.0 and events["restart"].detail["engine"] == 1
    assert events["freeze"].detail == {"engine": 3}
    assert gateway_settings(config, "engine", []).version_policy == "latest-only"
    assert gateway_settings(config, "wallclock", []).version_policy == "any"  # the plain proxy knows none
    assert "restart" not in {e.kind for e in timeline(ReplayConfig())}


@pytest.mark.parametrize(
    "bad",
    [
        {"engines": 2},  # the freeze, the failed update and the restart need three engines
        {"engines": 4, "restart_engine": 3},  # the frozen one
        {"engines": 4, "restart_at": 0.3},  # before the update
        {"engines": 4, "update_on_failure": "ignore"},  # not an on_failure of the gateway's
    ],
)
def test_version_faults_need_three_engines_and_a_restart_after_the_update(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ReplayConfig(version_faults=True, **bad)
