"""The trace round trip, measured: the incident recorded as a trace, the trace replayed, the figures side by side.

Theory of operation: for each seed, the incident replay runs with `--record-trace` (the recording), then its
engine-time trace, the clients' workload as they sent it, is replayed in both modes (`rolloutgate replay trace`).
`--again` runs each seed's recording a second time with no trace involved: the two recordings of one scenario
differ as much as the real-time run jitters, and that difference is the noise floor against which the round
trip's is read. The figures are summed over the seeds (the wallclock ones are counts of a few dozen that turn
on which turns a storm or the update lands on: one run is too few to read 10% in). It prints, per figure, the
recording, the replay of its trace, their ratio and whether it is within 10%, and the noise floor; and whether
every verdict is the same.

    python -m benchmarks.replay.round_trip --seeds 0 1 2 3 --again --out out/round-trip

writes OUT/round_trip.json and OUT/seed-N/{recorded,replayed,again}/ (each a replay's own output); `--reuse`
reads the runs already there (more seeds added to an earlier run).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from rolloutreplay.result import ReplayResult
from rolloutreplay.run import run_replay
from rolloutreplay.scenario import ReplayConfig
from rolloutreplay.trace_workload import trace_config

__all__ = ("FIGURES", "RoundTrip", "Run", "compare", "main", "round_trip")

TOLERANCE = 0.10

Figure = tuple[str, str, Callable[[dict[str, Any]], float]]

FIGURES: list[Figure] = [
    ("engine", "completed turns", lambda f: f["turns"]["completed"]),
    ("engine", "generations started", lambda f: f["generations"]),
    ("engine", "answers delivered", lambda f: f["answers_delivered"]),
    ("engine", "freeze -> detected (s)", lambda f: f["detection"]["detected_after_s"] or 0.0),
    ("wallclock", "client-visible failures (turns)", lambda f: f["client_visible_failures"]),
    ("wallclock", "spurious timeouts", lambda f: f["spurious_timeouts"]),
    ("wallclock", "wasted engine-seconds", lambda f: f["wasted_engine_seconds"]),
    ("wallclock", "completed turns", lambda f: f["turns"]["completed"]),
    ("wallclock", "generations started", lambda f: f["generations"]),
]


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """What the comparison reads of one replay: each mode's figures and the verdicts (its replay.json)."""

    figures: dict[str, dict[str, Any]]
    verdicts: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        return all(v["ok"] for v in self.verdicts)

    @classmethod
    def of(cls, result: ReplayResult) -> Run:
        return cls(figures=result.figures, verdicts=result.verdicts)

    @classmethod
    def read(cls, folder: Path) -> Run:
        """A replay's output folder, as `run_replay` wrote it."""
        summary = orjson.loads((folder / "replay.json").read_bytes())
        return cls(figures=summary["modes"], verdicts=summary["verdicts"])


@dataclasses.dataclass(frozen=True, slots=True)
class RoundTrip:
    """One seed: its recording, the replay of its trace, and (with --again) a second recording."""

    seed: int
    recorded: Run
    replayed: Run
    again: Run | None = None


def _verdicts(run: Run) -> list[tuple[str, str, bool]]:
    return [(v["mode"], v["claim"].split(" (")[0], v["ok"]) for v in run.verdicts]


def _total(runs: list[Run], mode: str, read: Callable[[dict[str, Any]], float]) -> float:
    return float(sum(read(r.figures[mode]) for r in runs))


def _ratio(a: float, b: float) -> float | None:
    return None if a == 0 else b / a


def compare(trips: list[RoundTrip]) -> dict[str, Any]:
    """Per figure: the recordings' total, the replays' total, their ratio, within 10%; the noise floor (the
    second recordings against the first) where there is one; and the verdicts of every run."""
    recorded = [t.recorded for t in trips]
    replayed = [t.replayed for t in trips]
    again = [t.again for t in trips if t.again is not None]
    rows = []
    for mode, label, read in FIGURES:
        a, b = _total(recorded, mode, read), _total(replayed, mode, read)
        ratio = _ratio(a, b)
        row: dict[str, Any] = {
            "mode": mode,
            "figure": label,
            "recorded": a,
            "replayed": b,
            "ratio": ratio,
            "within_10pct": ratio is not None and abs(ratio - 1.0) <= TOLERANCE,
        }
        if len(again) == len(trips):
            row["recorded_again"] = _total(again, mode, read)
            row["noise_ratio"] = _ratio(a, row["recorded_again"])
        rows.append(row)
    same = [_verdicts(t.replayed) == _verdicts(t.recorded) for t in trips]
    held = [r.passed for t in trips for r in (t.recorded, t.replayed)]
    return {
        "seeds": [t.seed for t in trips],
        "figures": rows,
        "same_verdicts": all(same),
        "every_verdict_held": all(held),
        "verdicts": {
            str(t.seed): {"recorded": t.recorded.verdicts, "replayed": t.replayed.verdicts} for t in trips
        },
    }


async def round_trip(base: ReplayConfig, seed: int, out: Path, *, again: bool, reuse: bool) -> RoundTrip:
    """One seed's recording, the replay of its engine-time trace and, with `again`, its second recording;
    with `reuse`, a run whose folder already holds its replay.json is read instead of run again."""
    folder = out / f"seed-{seed}"

    async def run(config: ReplayConfig, name: str) -> Run:
        if reuse and (folder / name / "replay.json").exists():
            return Run.read(folder / name)
        return Run.of(await run_replay(config, folder / name, plot=False))

    recording = dataclasses.replace(base, seed=seed, record_trace=str(folder / "recorded"))
    recorded = await run(recording, "recorded")
    config = trace_config(
        folder / "recorded" / "trace-engine.jsonl",
        time_scale=base.time_scale,
        seed=seed,
        client_timeout_s=base.client_timeout_s,
        reply_kept_tokens=base.reply_kept_tokens,
    )
    replayed = await run(config, "replayed")
    second = await run(dataclasses.replace(base, seed=seed), "again") if again else None
    return RoundTrip(seed=seed, recorded=recorded, replayed=replayed, again=second)


def _cell(value: float | None, *, ratio: bool = False) -> str:
    if value is None:
        return "-"
    return f"x{value:.2f}" if ratio else f"{value:,.1f}" if value % 1 else f"{value:,.0f}"


def table(summary: dict[str, Any]) -> Table:
    rows = summary["figures"]
    seeds = ", ".join(str(s) for s in summary["seeds"])
    out = Table(title=f"trace round trip, seeds {seeds} (totals over the seeds)", title_justify="left")
    for name in ("mode", "figure", "recorded", "replayed from its trace", "ratio", "within 10%"):
        out.add_column(name, justify="left" if name in ("mode", "figure") else "right")
    has_noise = "noise_ratio" in rows[0]
    if has_noise:
        out.add_column("recorded again", justify="right")
        out.add_column("noise ratio", justify="right")
    for row in rows:
        cells = [
            row["mode"],
            row["figure"],
            _cell(row["recorded"]),
            _cell(row["replayed"]),
            _cell(row["ratio"], ratio=True),
            "yes" if row["within_10pct"] else "no",
        ]
        if has_noise:
            cells += [_cell(row["recorded_again"]), _cell(row["noise_ratio"], ratio=True)]
        out.add_row(*cells)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="scenario seeds (default 0)")
    parser.add_argument("--again", action="store_true", help="record each seed twice: the noise floor")
    parser.add_argument(
        "--reuse", action="store_true", help="read the runs whose OUT/seed-N/<run>/replay.json exists"
    )
    parser.add_argument("--time-scale", type=float, default=ReplayConfig().time_scale)
    parser.add_argument("--out", type=Path, default=Path("out/round-trip"))
    args = parser.parse_args(argv)
    base = ReplayConfig(time_scale=args.time_scale)
    trips = [
        asyncio.run(round_trip(base, seed, args.out, again=args.again, reuse=args.reuse))
        for seed in args.seeds
    ]
    summary = compare(trips)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "round_trip.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    console = Console(width=max(Console().width, 120))  # the table's labels whole, in a log file too
    console.print(table(summary))
    console.print(
        f"same verdicts recorded and replayed: {'yes' if summary['same_verdicts'] else 'NO'}; "
        f"every verdict held: {'yes' if summary['every_verdict_held'] else 'NO'}"
    )
    return 0 if summary["same_verdicts"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
