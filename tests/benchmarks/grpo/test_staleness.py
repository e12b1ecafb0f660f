"""Length bias of the staleness bound (benchmarks/grpo/staleness.py): on a small run, `requeue` throws long
generations away and what the trainer gets is shorter than what was asked; `pace` throws nothing away, and its
gateway never admits more than the budget."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.grpo.staleness import StalenessConfig, run_staleness

SMALL = StalenessConfig(
    engines=2, workers=48, batch=24, steps=8, asked_median=600, asked_max=8_000, train_s=10.0
)


def test_requeue_throws_long_generations_away_and_pace_none() -> None:
    requeue = run_staleness(replace(SMALL, mode="requeue")).summary()
    pace = run_staleness(replace(SMALL, mode="pace")).summary()
    assert requeue["steps"] == pace["steps"] == SMALL.steps
    assert requeue["wasted_tokens"] > 0 and pace["wasted_tokens"] == 0
    assert requeue["delivered"]["p90"] < pace["delivered"]["p90"]  # requeue's deliveries short at the tail


def test_pace_admits_no_more_than_the_budget() -> None:
    """By the last version the budget is batch x (steps + K + 1); the workers ask for more than that."""
    budget = SMALL.batch * (SMALL.steps + SMALL.max_staleness + 1)
    pace = run_staleness(replace(SMALL, mode="pace"))
    requeue = run_staleness(replace(SMALL, mode="requeue"))
    assert len(pace.consumed) == SMALL.batch * SMALL.steps
    assert pace.admitted <= budget < len(pace.asked)
    assert requeue.admitted > budget  # without the pace every generation asked for starts
