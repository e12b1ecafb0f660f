"""The GRPO bench (benchmarks/grpo/world.py): groups placed together prefill less and end sooner, same seed."""

from __future__ import annotations

import pytest

from benchmarks.grpo.__main__ import main
from benchmarks.grpo.world import GrpoConfig, run_grpo

SMALL = GrpoConfig(engines=4, groups=4, n=8, prompt_tokens=8000, min_new_tokens=32, max_new_tokens=96)


def test_grouped_samples_prefill_less_and_their_groups_end_sooner() -> None:
    off = run_grpo(SMALL, grouped=False)
    on = run_grpo(SMALL, grouped=True)
    assert off.prompt_tokens == on.prompt_tokens == SMALL.groups * SMALL.n * SMALL.prompt_tokens
    assert on.prefill_tokens < off.prefill_tokens
    assert on.hit_rate > off.hit_rate
    assert on.estimated_saved_tokens > 0 and off.estimated_saved_tokens == 0  # no group, no record
    assert on.groups_finished == off.groups_finished == SMALL.groups
    assert max(on.group_completion_s) < max(off.group_completion_s)
    assert on.failed_samples == off.failed_samples == 0
    assert run_grpo(SMALL, grouped=True).summary() == on.summary()  # same seed, same numbers


def test_the_command_prints_both_runs_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--engines", "2", "--groups", "2", "--n", "2", "--prompt-tokens", "4000",
                 "--min-new-tokens", "16", "--max-new-tokens", "32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| | ungrouped | grouped |" in out and "| prefill tokens saved by groups |" in out


def test_a_workload_without_samples_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        GrpoConfig(n=0)
