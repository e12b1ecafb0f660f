"""Agent trajectories in groups (benchmarks/grpo/agents.py): every trajectory runs all its turns under each
placement, and under consistent hashing each session's engine is the one its key hashes to."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.grpo.agents import AgentsConfig, run_agents
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
