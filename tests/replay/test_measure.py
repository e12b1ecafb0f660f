"""The replay's RL rows (rolloutreplay/measure.py, report.py): tokens saved by session token budgets (the
gateway's counter, and the agents' own count of tokens not generated past the budget), prefill tokens saved by
groups, requests aborted as stale and partial samples, read from the gateway's /metrics (0 where absent)."""

from __future__ import annotations

from typing import Any

from rolloutreplay.measure import measure
from rolloutreplay.report import markdown_report
from rolloutreplay.result import ReplayResult
from rolloutreplay.scenario import ReplayConfig
from tests.replay.mode_records import mode_records


def turn(tag: str, *, max_tokens: int, completion: int, ok: bool | None, budget_full: bool = False) -> dict:
    return {
        "tag": tag,
        "agent": "a00",
        "session": tag.rsplit("-", 1)[0],
        "turn": 0,
        "kind": "medium",
        "max_tokens": max_tokens,
        "prompt_tokens": 100_000,
        "started_at": 10.0,
        "ended_at": None if ok is None else 200.0,
        "ok": ok,
        "error": None if ok is not False else "ContextWindowExceededError",
        "message": None,
        "completion_tokens": completion,
        "budget_full": budget_full,
    }


def records(turns: list[dict[str, Any]], counters: dict[str, float] | None) -> dict[str, Any]:
    extra = {} if counters is None else {"gateway_counters": counters}
    return mode_records(ReplayConfig(max_seq_len=120_000), 1, turns=turns, **extra)


TURNS = [
    turn("s0-t0", max_tokens=3_000, completion=3_000, ok=True),  # within its budget
    turn("s0-t1", max_tokens=24_000, completion=14_500, ok=True),  # capped: 9,500 not generated
    turn("s0-t2", max_tokens=10_000, completion=0, ok=False, budget_full=True),  # refused at a full budget
    turn("s1-t0", max_tokens=8_000, completion=0, ok=None),  # still running at the end
]
COUNTERS = {
    "budget_tokens_saved": 19_500.0,  # the gateway counts the refused turn's ask too
    "group_prefill_tokens_saved": 412_000.0,
    "stale_requeued": 3.0,
    "stale_partial": 2.0,
}


def test_the_rl_rows_read_the_gateways_counters_and_the_agents_turns() -> None:
    figures = measure(records(TURNS, COUNTERS))
    assert figures["budgets"] == {
        "max_seq_len": 120_000,
        "tokens_saved": 19_500,
        "tokens_not_generated": 9_500,
        "turns_capped": 1,
        "turns_at_full_budget": 1,
    }
    # a session that spent its budget ended there: not a client-visible failure
    assert figures["client_visible_failures"] == 0 and figures["turns"]["completed"] == 2
    assert figures["group_prefill_tokens_saved"] == 412_000
    assert figures["stale_requests"] == {"requeued": 3, "partial": 2}
    table = markdown_report(ReplayResult(ReplayConfig(), {"engine": figures}, {}))
    cells = [line.strip("|").split("|") for line in table.splitlines() if line.count("|") == 3]
    rows = {label.strip(): value.strip() for label, value in cells}
    assert rows["prefill tokens saved (groups)"] == "412,000"
    assert rows["tokens saved by budgets"] == "19,500 (1 turns capped, 1 refused at a full budget)"
    assert rows["aborted as stale (requeued)"] == "3"
    assert rows["partial samples (stale, answered so far)"] == "2"


def test_counters_a_gateway_does_not_export_read_0() -> None:
    figures = measure(records(TURNS[:1], None))  # records of a gateway without them (or from before them)
    assert figures["budgets"]["tokens_saved"] == 0 and figures["budgets"]["tokens_not_generated"] == 0
    assert figures["group_prefill_tokens_saved"] == 0
    assert figures["stale_requests"] == {"requeued": 0, "partial": 0}
    table = markdown_report(ReplayResult(ReplayConfig(), {"engine": figures}, {}))
    assert "| tokens saved by budgets | 0 |" in table and "| aborted as stale (requeued) | 0 |" in table
