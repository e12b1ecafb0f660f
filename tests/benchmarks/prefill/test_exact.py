"""The exact world (benchmarks/prefill/exact_world.py) and its comparison (benchmarks/prefill/exact.py).

A scaled-down incident (2 engines, 4 agents with 20-30K-token histories, one storm of 4 sessions, 500 simulated
seconds; well under a second a run) checks that a run is exactly repeatable, that stopping the engines only at
their critical moments gives the same numbers as stopping them at every step, that both modes are measured, and
that the prefill budget holds in the "on" run (and does not in "off", so the check can fail). The physics check
puts a session's two turns through the exact world and the same prompts through the HTTP simulator: the engine
times must agree. The 40-seed comparison itself is `make prefill-exact`, outside `make test`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import aiohttp
import pytest

from benchmarks.prefill.exact import (
    ROWS,
    bootstrap_changes,
    max_long_prefills_at_once,
    measure,
    pool_runs,
    run_seeds,
)
from benchmarks.prefill.exact_agents import CLIENT_ATTEMPTS, ExactAgents
from benchmarks.prefill.exact_world import ExactWorld, run_exact
from benchmarks.prefill.measure import table
from rolloutreplay.scenario import ReplayConfig, agent_plan
from rolloutsim import SimCluster

SMALL = ReplayConfig(
    agents=4,
    engines=2,
    duration_s=500.0,
    history_tokens=(20_000, 30_000),
    opening_tokens=(300, 600),
    medium_tokens=(800, 1_500),
    long_tokens=(2_500, 3_000),
    storm_sessions=4,
    storm_tokens=(100, 200),
    storms_at=(0.3,),
    start_spread_s=20.0,
)


def _same(a: object, b: object) -> None:
    assert a == b  # dataclass equality: every record, every float


def test_a_run_is_exactly_repeatable() -> None:
    first, second = run_exact(SMALL, "on"), run_exact(SMALL, "on")
    _same(first, second)
    assert first.turns and first.generations
    other_seed = run_exact(replace(SMALL, seed=1), "on")
    assert other_seed.turns != first.turns


@pytest.mark.parametrize(("mode", "weight_update"), [("off", False), ("on", False), ("on", True)])
def test_stopping_only_at_critical_moments_changes_nothing(mode: str, weight_update: bool) -> None:
    fast = ExactWorld(SMALL, mode, weight_update=weight_update).run()
    every_step = ExactWorld(SMALL, mode, weight_update=weight_update, step_by_step=True).run()
    _same(fast, every_step)


def test_the_weight_update_pauses_every_engine_and_the_gate() -> None:
    records = run_exact(SMALL, "on", weight_update=True)
    update_at = SMALL.update_at * SMALL.duration_s
    assert [(h["engine"], h["start_at"], h["end_at"]) for h in records.holds] == [
        (e, update_at, update_at + 25.0) for e in range(SMALL.engines)
    ]
    across = [
        g
        for g in records.generations
        if g["first_token_at"] is not None
        and g["first_token_at"] < update_at
        and (g["finished_at"] or math.inf) > update_at + 25.0
    ]
    assert across  # decodes held in place through the update, and they resumed
    assert all(any(t > update_at + 25.0 for t in g["token_times"]) for g in across)
    during = [t for g in records.generations for t in g["token_times"] if update_at < t < update_at + 25.0]
    assert during == []  # paused in place: no engine produced a token
    dispatched = [g["submitted_at"] for g in records.generations]
    assert not any(update_at <= t < update_at + 25.0 for t in dispatched)  # the gate was closed
    assert run_exact(SMALL, "on").holds == []


def test_both_modes_are_measured_on_the_same_seed() -> None:
    per_mode = run_seeds(SMALL, [0, 1], workers=1)
    assert [f["seed"] for f in per_mode["off"]] == [0, 1] == [f["seed"] for f in per_mode["on"]]
    for mode in ("off", "on"):
        for f in per_mode[mode]:
            assert f["mode"] == mode
            assert f["turns_completed"] > 10 and f["turns_failed"] == 0
            assert f["tokens_per_s"] > 0 and f["colocated_generations"] > 0
            assert len(f["storm_span_s"]) == 1 and f["storm_span_s"][0] > 0
    figures = {m: pool_runs(per_mode[m]) for m in ("off", "on")}
    text = table(figures, ROWS)
    assert text.count("\n") == len(ROWS) + 1
    assert "long prefills in flight on one engine at once, most" in text
    changes = bootstrap_changes(per_mode, resamples=200)
    assert set(changes) == {
        "turn_latency_p99_s",
        "turn_latency_p50_s",
        "tokens_per_s",
        "colocated_decode_rate_mean",
    }
    for c in changes.values():
        assert c["low"] <= c["high"] and all(math.isfinite(v) for v in c.values())
    # the point estimate is the change of the pooled figures
    assert changes["tokens_per_s"]["change"] == pytest.approx(
        figures["on"]["tokens_per_s"] / figures["off"]["tokens_per_s"] - 1
    )


def test_the_prefill_budget_holds_on_and_not_off() -> None:
    on = ExactWorld(SMALL, "on")
    assert on.prefill_budget == 2048  # the incident profile: 512-token chunks, 256 slots
    on_records = on.run()
    off = ExactWorld(SMALL, "off")
    assert off.prefill_budget == math.inf
    off_records = off.run()
    # every long prompt (>= 4,096 uncached tokens) is larger than the whole budget, so it must run alone
    assert measure(on_records)["long_prefills_at_once"] == 1
    assert measure(off_records)["long_prefills_at_once"] >= 2  # the storm's prompts stack without it


def test_long_prefills_at_once_counts_overlaps_per_engine() -> None:
    def gen(engine: int, start: float, first: float | None, uncached: int = 20_000) -> dict[str, object]:
        return {
            "engine": engine,
            "prompt_tokens": uncached,
            "cached_tokens": 0,
            "submitted_at": start,
            "started_at": start,
            "first_token_at": first,
            "finished_at": None,
        }

    back_to_back = [gen(0, 0.0, 10.0), gen(0, 10.0, 20.0), gen(1, 5.0, 15.0)]
    assert max_long_prefills_at_once(back_to_back, 100.0) == 1
    overlapping = [*back_to_back, gen(0, 15.0, None), gen(0, 1.0, 2.0, uncached=1_000)]
    assert max_long_prefills_at_once(overlapping, 100.0) == 2
    not_admitted = {**gen(1, 6.0, None), "started_at": None}  # its cached tokens are not known yet
    assert max_long_prefills_at_once([*back_to_back, not_admitted], 100.0) == 1


def test_the_engine_physics_match_the_http_simulator() -> None:
    """One session's two turns, alone: the exact world's generations against the same prompts sent to an
    `incident` engine of the HTTP simulator (the second turn hits the first one's cache on both)."""
    config = replace(
        SMALL,
        agents=1,
        storms_at=(),
        turns_per_session=2,
        history_tokens=(20_000, 20_000),
        start_spread_s=0.0,
    )
    world = ExactWorld(config, "on")
    records = world.run()
    gens = sorted(records.generations, key=lambda g: g["submitted_at"])[:2]
    assert len(gens) == 2 and gens[1]["cached_tokens"] > 0
    prompts = [t["prompt_tokens"] for t in records.turns[:2]]
    lengths = [t["max_tokens"] for t in records.turns[:2]]
    first_ids = list(range(3, prompts[0] + 3))  # word ids the simulator accepts
    second_ids = first_ids + list(range(100_000, 100_000 + prompts[1] - prompts[0]))
    http = asyncio.run(_through_http([first_ids, second_ids], lengths))
    for exact, sim in zip(gens, http, strict=True):
        assert sim["prompt_tokens"] == exact["prompt_tokens"]
        assert sim["cached_tokens"] == exact["cached_tokens"]
        assert sim["completion_tokens"] == exact["completion_tokens"]
        for key in ("first_token_at", "finished_at"):
            assert sim[key] - sim["submitted_at"] == pytest.approx(
                exact[key] - exact["submitted_at"], abs=1e-6
            )


async def _through_http(prompts: list[list[int]], lengths: list[int]) -> list[dict[str, float]]:
    out = []
    async with (
        SimCluster(engines=1, api="sglang", profile="incident", time_scale=2000.0) as cluster,
        aiohttp.ClientSession() as http,
    ):
        for index, (ids, length) in enumerate(zip(prompts, lengths, strict=True)):
            body = {
                "rid": f"turn{index}",
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": length, "ignore_eos": True},
            }
            async with http.post(f"{cluster.urls[0]}/generate", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            req = cluster.engines[0].model.request(f"turn{index}")
            assert req is not None and req.first_token_at is not None and req.finished_at is not None
            out.append(
                {
                    "prompt_tokens": req.prompt_tokens,
                    "cached_tokens": req.cached_tokens,
                    "completion_tokens": req.completion_tokens,
                    "submitted_at": req.submitted_at,
                    "first_token_at": req.first_token_at,
                    "finished_at": req.finished_at,
                }
            )
    return out


def test_agents_walk_their_plans_and_retry_a_failed_call() -> None:
    config = replace(SMALL, agents=1, start_spread_s=0.0)
    calls: list[tuple[str, str, int, float]] = []
    agents = ExactAgents(config, lambda *call: calls.append(call))
    assert agents.next_wakeup_at() == 0.0
    agents.wake_due(0.0)
    (first,) = calls
    request_id, session, prompt, _ = first
    plan = agent_plan(config, 0).next_session()
    assert session == "a00-s0" and prompt == plan.history_tokens + 16
    assert agents.call(request_id).turn.max_tokens == plan.turns[0].max_tokens
    agents.answered(request_id, 50.0)  # the tool runs, then the next turn, with the history grown
    assert agents.next_wakeup_at() == pytest.approx(50.0 + plan.turns[0].tool_time_s)
    agents.wake_due(agents.next_wakeup_at())
    second = calls[-1]
    kept = min(config.reply_kept_tokens, plan.turns[0].max_tokens)  # the answer's head, at most ~1K tokens
    assert second[1] == "a00-s0" and second[2] == prompt + kept + config.tool_tokens
    for attempt in range(CLIENT_ATTEMPTS):  # the client tries again, then gives the turn up
        assert len(calls) == 2 + attempt
        agents.failed(calls[-1][0], 100.0 + attempt)
    assert [t["ok"] for t in agents.turn_records()] == [True, False]
    assert len(agents.turn_records()[1]["request_ids"]) == CLIENT_ATTEMPTS
    agents.wake_due(200.0)  # a failed turn ends its session: the next one starts cold
    assert calls[-1][1] == "a00-s1" and calls[-1][2] > 20_000


def test_the_cadence_of_progress_reports_changes_nothing() -> None:
    """Only a first token and an end make the core act; the reports in between only feed its liveness."""
    _same(run_exact(SMALL, "on", progress_every_tokens=16), run_exact(SMALL, "on", progress_every_tokens=64))
