"""The round trip's comparison (benchmarks/replay/round_trip.py): totals over the seeds, ratios, the 10% line, the noise
floor, and the verdicts compared run by run. The runs themselves: tests/replay/test_trace_replay.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from benchmarks.replay.round_trip import FIGURES, RoundTrip, Run, compare, table


def _figures(scale: float) -> dict[str, Any]:
    return {
        "turns": {"completed": 100 * scale},
        "generations": 120 * scale,
        "answers_delivered": 100 * scale,
        "detection": {"detected_after_s": 60.0 * scale},
        "client_visible_failures": 10 * scale,
        "spurious_timeouts": 40 * scale,
        "wasted_engine_seconds": 20_000.0 * scale,
    }


def run(scale: float, *, ok: bool = True) -> Run:
    figures = {mode: _figures(scale) for mode in ("engine", "wallclock")}
    return Run(figures=figures, verdicts=[{"mode": "engine", "claim": "0 spurious timeouts (x)", "ok": ok}])


def trip(
    seed: int, recorded: float, replayed: float, *, again: float | None = None, ok: bool = True
) -> RoundTrip:
    return RoundTrip(
        seed=seed,
        recorded=run(recorded),
        replayed=run(replayed, ok=ok),
        again=None if again is None else run(again),
    )


def test_figures_are_totals_over_the_seeds_with_their_ratio_and_the_10_percent_line() -> None:
    summary = compare([trip(0, 1.0, 1.05), trip(1, 1.0, 1.25)])
    rows = {(r["mode"], r["figure"]): r for r in summary["figures"]}
    assert len(rows) == len(FIGURES)
    failures = rows[("wallclock", "client-visible failures (turns)")]
    assert (failures["recorded"], failures["replayed"]) == (20, pytest.approx(23.0))
    assert failures["ratio"] == pytest.approx(1.15) and failures["within_10pct"] is False
    assert "noise_ratio" not in failures  # no second recordings
    assert summary["same_verdicts"] and summary["every_verdict_held"]


def test_within_10_percent_and_the_noise_floor() -> None:
    summary = compare([trip(0, 1.0, 1.08, again=0.9)])
    assert all(r["within_10pct"] for r in summary["figures"])
    assert all(r["noise_ratio"] == pytest.approx(0.9) for r in summary["figures"])
    assert table(summary).row_count == len(FIGURES)


def test_a_verdict_that_differs_is_reported() -> None:
    summary = compare([trip(0, 1.0, 1.0), trip(1, 1.0, 1.0, ok=False)])
    assert summary["same_verdicts"] is False and summary["every_verdict_held"] is False


def test_a_figure_that_was_zero_has_no_ratio_and_is_not_within() -> None:
    summary = compare([trip(0, 0.0, 1.0)])
    assert all(r["ratio"] is None and not r["within_10pct"] for r in summary["figures"])


def test_a_run_is_read_back_from_its_replay_json(tmp_path: Path) -> None:
    written = run(1.0)
    summary = {"config": {}, "modes": written.figures, "verdicts": written.verdicts, "wall_seconds": 1.0}
    (tmp_path / "replay.json").write_bytes(orjson.dumps(summary))
    assert Run.read(tmp_path) == written and written.passed
