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
