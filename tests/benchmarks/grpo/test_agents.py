"""Agent trajectories in groups (benchmarks/grpo/agents.py): every trajectory runs all its turns under each
placement, and under consistent hashing each session's engine is the one its key hashes to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.grpo.agents import SKYRL_1791, AgentsConfig, run_agents
from rolloutgate.core.placement.consistent_hash import rendezvous_score

SMALL = AgentsConfig(engines=3, groups=4, n=3, prompt_tokens=500, max_turns=4, answer_median=100)


@pytest.mark.parametrize("placement", ["consistent_hash", "sticky_least_loaded", "prefill_aware"])
def test_every_group_completes_its_trajectories(placement: str) -> None:
    run = run_agents(replace(SMALL, placement=placement))
    summary = run.summary()
    assert summary["groups"] == SMALL.groups and run.failed_turns == 0
    assert sum(run.sessions_per_engine) == SMALL.groups * SMALL.n
    assert 0 < summary["hit_rate"] < 1 and summary["group_completion_s"]["max"] <= run.makespan_s


def test_consistent_hashing_puts_each_session_where_its_key_scores_highest() -> None:
    run = run_agents(replace(SMALL, placement="consistent_hash"))
    expected = [0] * SMALL.engines
    for g in range(SMALL.groups):
        for k in range(SMALL.n):
            key = f"g{g:03d}-t{k}"
            scores = [rendezvous_score(key, f"engine-{i}") for i in range(SMALL.engines)]
            expected[scores.index(max(scores))] += 1
    assert run.sessions_per_engine == expected


CLOSED = replace(
    SMALL,
    groups=6,
    workers=3,
    mini_batch=2,
    max_staleness=1,
    train_s=5.0,
    max_concurrency=5,
    max_model_len=2000,
    token_pool=True,
    uuid_keys=True,
    probe_s=2.0,
)


@pytest.mark.parametrize("placement", ["consistent_hash", "sticky_least_loaded"])
def test_closed_loop_runs_skyrls_trainer_bounds(placement: str) -> None:
    """SkyRL's fully async loop (the skyrl1791 profile's, small): every group completes, never more trajectories
    at once than the rate limiter's max_concurrency, never more groups than the workers."""
    run = run_agents(replace(CLOSED, placement=placement))
    assert len(run.group_completion_s) == CLOSED.groups and run.failed_turns == 0
    assert run.peak_trajectories == CLOSED.max_concurrency and run.peak_groups <= CLOSED.workers
    assert sum(run.sessions_per_engine) == CLOSED.groups * CLOSED.n
    engines = run.engine_summary()
    assert run.running and len(engines["wait_mean_s"]) == CLOSED.engines
    assert all(k >= 0 for k in engines["kv_max"]) and engines["run_cv"] >= 0


def test_skyrl_profile_is_the_prs_load() -> None:
    """The fields SkyRL#1791 states (its PR description: Setup)."""
    assert (SKYRL_1791.engines, SKYRL_1791.n, SKYRL_1791.workers, SKYRL_1791.mini_batch) == (4, 16, 12, 4)
    assert (SKYRL_1791.max_staleness, SKYRL_1791.train_s, SKYRL_1791.max_concurrency) == (4, 60.0, 132)
    assert SKYRL_1791.max_model_len == 128_000


def test_skyrl_profile_preempts_under_kv_pressure() -> None:
    """The profile turns on the engine model's KV preemption; a small closed loop on a KV too small for its
    trajectories preempts, and every group still completes (a preempted call is prefilled again, not lost)."""
    assert SKYRL_1791.kv_preemption and SKYRL_1791.kv_capacity_tokens == 876_000
    tight = replace(
        CLOSED, engines=1, kv_preemption=True, kv_capacity_tokens=3_000, placement="consistent_hash"
    )
    run = run_agents(tight)
    assert len(run.group_completion_s) == CLOSED.groups and run.failed_turns == 0
    assert len(run.preemptions) == 1 and sum(run.preemptions) > 0
    assert run.engine_summary()["preemptions"] == run.preemptions
    assert sum(run_agents(replace(tight, kv_preemption=False)).preemptions) == 0
