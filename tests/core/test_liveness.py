from __future__ import annotations

import math

import pytest

from rolloutgate.core.liveness import EngineLiveness, prefill_allowance_s

ARGS = {"floor_tokens_per_s": 2000.0, "max_allowance_s": 300.0}


@pytest.mark.parametrize(
    ("tokens", "allowance"), [(0, 0.0), (2000, 1.0), (100_000, 50.0), (10_000_000, 300.0)]
)
def test_prefill_allowance(tokens: int, allowance: float) -> None:
    assert prefill_allowance_s(tokens, **ARGS) == allowance


def test_window_is_min_stall_from_latest_of_progress_busy_resume() -> None:
    live = EngineLiveness(now=0.0)
    live.add_request(60.0)
    live.add_request(30.0)
    live.add_request(30.0)
    live.note_busy(10.0)
    assert live.due_at(**ARGS) == 40.0
    live.last_progress_at = 25.0
    assert live.due_at(**ARGS) == 55.0
    live.note_resumed(100.0)
    assert live.due_at(**ARGS) == 130.0
    live.remove_request(30.0)
    assert live.min_stall_timeout_s() == 30.0
    live.remove_request(30.0)
    assert live.min_stall_timeout_s() == 60.0
    live.large_prefill_tokens = 100_000
    assert live.due_at(**ARGS) == 100.0 + 60.0 + 50.0


def test_pool_level_stall_timeout_caps_the_window() -> None:
    live = EngineLiveness(now=0.0, pool_stall_timeout_s=20.0)
    live.add_request(60.0)
    assert live.min_stall_timeout_s() == 20.0
    assert EngineLiveness(now=0.0).min_stall_timeout_s() == math.inf


def test_an_engine_is_cold_until_its_first_progress_and_again_after_a_failed_check() -> None:
    live = EngineLiveness(now=0.0)
    live.add_request(60.0)
    assert live.is_cold()
    assert live.window_s(warmup_s=300.0) == 300.0  # its first work may be a compile
    assert live.due_at(**ARGS, warmup_s=300.0) == 300.0
    live.large_prefill_tokens = 100_000  # a long first prefill: the allowance comes on top
    assert live.due_at(**ARGS, warmup_s=300.0) == 350.0
    live.large_prefill_tokens = 0
    live.last_progress_at = 120.0
    assert not live.is_cold() and live.window_s(warmup_s=300.0) == 60.0
    assert live.due_at(**ARGS, warmup_s=300.0) == 180.0
    live.note_cold(200.0)  # it failed a health check: it may be starting again
    assert live.is_cold() and live.window_s(warmup_s=300.0) == 300.0
    live.last_progress_at = 201.0
    assert not live.is_cold()


def test_a_warm_up_shorter_than_the_stall_window_changes_nothing() -> None:
    live = EngineLiveness(now=0.0)
    live.add_request(60.0)
    assert live.window_s(warmup_s=30.0) == 60.0 and live.window_s(warmup_s=0.0) == 60.0


def test_the_pause_check_comes_before_the_window_ends_and_the_verdict_at_its_end() -> None:
    live = EngineLiveness(now=0.0)
    live.add_request(60.0)
    due = live.due_at(**ARGS)
    assert (live.next_step_at(due, 2.0), live.judged_at(due, 2.0)) == (58.0, 60.0)
    assert live.ask_check(58.0) and not live.ask_check(58.5)  # once per silence
    assert (live.next_step_at(due, 2.0), live.judged_at(due, 2.0)) == (60.0, 60.0)
    late = EngineLiveness(now=0.0)
    late.add_request(1.0)  # a window shorter than the check: the check still gets its 2 s
    assert late.next_step_at(late.due_at(**ARGS), 2.0) == -1.0
    assert late.ask_check(0.0) and late.judged_at(late.due_at(**ARGS), 2.0) == 2.0
    live.last_progress_at = 59.0  # progress: a new silence, a new check
    assert live.next_step_at(live.due_at(**ARGS), 2.0) == 117.0
    assert live.next_step_at(live.due_at(**ARGS), 0.0) == 119.0  # no check: the verdict at the end
    assert "cold" not in repr(live) and "cold" in repr(EngineLiveness(now=0.0))
