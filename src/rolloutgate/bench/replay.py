"""The incident replay: both modes side by side, measured, reported (table, JSON, PNG).

Theory of operation: `run_replay` starts one worker process per mode (replay_worker.py), each running the same
scenario (replay_scenario.py) against its own simulated engines and its own gateway, engine time in one,
`--clock wallclock` in the other. While they run, their progress lines drive a progress bar. Then it measures
each mode's records (replay_measure.py), checks what the replay must show (`verdicts`), and writes:

    DIR/replay.json          the figures of both modes, the verdicts, the configuration
    DIR/replay.md            the same table and verdicts in markdown
    DIR/replay.png           per-engine timelines of both modes and the waste per mode (replay_plot.py)
    DIR/records-<mode>.json  every record of a mode (agents, gateway, engines), for further analysis
    DIR/replay-<mode>.log    the worker's log

`in_process=True` runs the modes concurrently in this process instead, on one event loop (for tests, where
LiteLLM is imported once; the modes then share one core).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rolloutgate.bench.replay_measure import measure
from rolloutgate.bench.replay_scenario import MODES, ReplayConfig
from rolloutgate.bench.replay_world import ModeRecords, run_mode

__all__ = ("ReplayResult", "WorkerJob", "report_replay", "run_replay", "run_workers", "verdicts")

Progress = Callable[[dict[str, Any]], None]


class ReplayResult:
    """The measured figures of each mode, the verdicts, and where the files went."""

    def __init__(
        self, config: ReplayConfig, figures: dict[str, dict[str, Any]], records: dict[str, ModeRecords]
    ):
        self.config = config
        self.figures = figures
        self.records = records
        self.verdicts = verdicts(config, figures)

    @property
    def passed(self) -> bool:
        return all(v["ok"] for v in self.verdicts)

    def summary(self) -> dict[str, Any]:
        figures = {mode: {k: v for k, v in f.items() if k != "kills"} for mode, f in self.figures.items()}
        return {"config": self.config.to_json(), "modes": figures, "verdicts": self.verdicts}


def verdicts(config: ReplayConfig, figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """What the replay must show, each with the measured value and whether it holds."""
    out: list[dict[str, Any]] = []

    def check(mode: str, claim: str, ok: bool, measured: Any) -> None:
        out.append({"mode": mode, "claim": claim, "ok": bool(ok), "measured": measured})

    engine, wall = figures.get("engine"), figures.get("wallclock")
    if engine is not None:
        check("engine", "0 spurious timeouts", engine["spurious_timeouts"] == 0, engine["spurious_timeouts"])
        check(
            "engine",
            "0 client-visible failures among progressing requests",
            engine["client_visible_failures_progressing"] == 0,
            engine["client_visible_failures_progressing"],
        )
        if wall is not None:
            limit = 0.01 * wall["wasted_engine_seconds"]
            check(
                "engine",
                "wasted engine-seconds <= 1% of wallclock's",
                engine["wasted_engine_seconds"] <= limit,
                f"{engine['wasted_engine_seconds']:.0f} <= {limit:.0f}",
            )
        detection = engine["detection"]
        after = detection.get("detected_after_s")
        allowance = detection.get("prefill_allowance_s") or 0.0
        bound = 1.1 * config.stall_timeout_s + allowance
        extra = f" + {allowance:.0f} s of prefill allowance" if allowance else ""
        check(
            "engine",
            f"frozen engine detected within stall_timeout + 10% ({1.1 * config.stall_timeout_s:.0f} s{extra})",
            after is not None and after <= bound,
            None if after is None else round(after, 1),
        )
        frozen = engine["frozen_engine_requests"]
        caught = frozen.get("caught", 0)
        elsewhere = frozen.get("answered_by_other_engines", 0)
        moving = frozen.get("still_running_elsewhere_at_end", 0)
        check(
            "engine",
            "the frozen engine's requests answered by the other engines (or still running there at the end)",
            elsewhere + moving == caught and frozen.get("failed", 0) == 0,
            f"{elsewhere}/{caught}" + (f" + {moving} running" if moving else ""),
        )
    if wall is not None:
        events = wall["events"]
        check(
            "wallclock",
            "timeouts in bursts after prefill storms and the weight update",
            bool(events) and all(e["fitting_killed"] > 0 for e in events),
            ", ".join(f"{e['kind']} {e['fitting_killed']}/{e['fitting_in_flight']}" for e in events),
        )
        chain = wall["failed_turn_chain_s_median"]
        three = wall["failed_turn_attempts"].get("3", wall["failed_turn_attempts"].get(3, 0))
        expected = 3 * config.client_timeout_s
        check(
            "wallclock",
            f"3-attempt retry chains of about 3 x the client timeout ({expected:.0f} s)",
            chain is not None and three > 0 and abs(chain - expected) <= 0.15 * expected,
            None if chain is None else f"{three} chains, median {chain:.0f} s",
        )
    return out


def _worker_command(config: ReplayConfig, mode: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rolloutgate.bench.replay_worker",
        "--mode",
        mode,
        "--config",
        orjson.dumps(config.to_json()).decode(),
        "--out",
        str(out),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerJob:
    """One worker process: a mode of a configuration; `label` names its files (records-<label>.json,
    replay-<label>.log) and tags its progress lines."""

    label: str
    config: ReplayConfig
    mode: str


async def run_workers(
    jobs: Sequence[WorkerJob], out_dir: Path, progress: Progress | None = None
) -> dict[str, ModeRecords]:
    """Run the jobs at once, one worker process each, their clocks started together; their records by label.
    Raises RuntimeError if a worker fails."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}
    processes: dict[str, asyncio.subprocess.Process] = {}
    logs = {}
    try:
        for job in jobs:
            logs[job.label] = (out_dir / f"replay-{job.label}.log").open("wb")
            processes[job.label] = await asyncio.create_subprocess_exec(
                *_worker_command(job.config, job.mode, out_dir / f"records-{job.label}.json"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logs[job.label],
                env=env,
            )

        waiting = set(processes)

        def release_when_all_ready(label: str) -> None:
            # all jobs start their clocks together: none runs while another is loading LiteLLM
            waiting.discard(label)
            if not waiting:
                for process in processes.values():
                    assert process.stdin is not None
                    process.stdin.write(b"go\n")

        async def follow(label: str, process: asyncio.subprocess.Process) -> int:
            assert process.stdout is not None
            async for line in process.stdout:
                if not line.strip():
                    continue
                state = orjson.loads(line)
                if state.get("ready"):
                    release_when_all_ready(label)
                elif progress is not None:
                    progress(state | {"label": label})
            return await process.wait()

        codes = await asyncio.gather(*(follow(m, p) for m, p in processes.items()))
    finally:
        for process in processes.values():
            if process.returncode is None:
                process.kill()
                await process.wait()
        for log in logs.values():
            log.close()
    failed = [m for m, code in zip(processes, codes, strict=True) if code != 0]
    if failed:
        raise RuntimeError(f"replay worker(s) {failed} failed; see {out_dir}/replay-<label>.log")
    return {
        label: ModeRecords.from_json(orjson.loads((out_dir / f"records-{label}.json").read_bytes()))
        for label in processes
    }


async def _run_workers(
    config: ReplayConfig, modes: tuple[str, ...], out_dir: Path, progress: Progress | None
) -> dict[str, ModeRecords]:
    return await run_workers([WorkerJob(label=m, config=config, mode=m) for m in modes], out_dir, progress)


async def _run_in_process(
    config: ReplayConfig, modes: tuple[str, ...], out_dir: Path, progress: Progress | None
) -> dict[str, ModeRecords]:
    results = await asyncio.gather(*(run_mode(config, mode, progress) for mode in modes))
    records = dict(zip(modes, results, strict=True))
    for mode, record in records.items():
        (out_dir / f"records-{mode}.json").write_bytes(orjson.dumps(record.to_json()))
    return records


async def run_replay(
    config: ReplayConfig,
    out_dir: Path,
    *,
    modes: tuple[str, ...] = MODES,
    in_process: bool = False,
    progress: Progress | None = None,
    plot: bool = True,
) -> ReplayResult:
    """Run the modes, measure them, write the JSON (and the PNG); see the module docstring."""
    out_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    started = time.perf_counter()
    runner = _run_in_process if in_process else _run_workers
    records = await runner(config, modes, out_dir, progress)
    return report_replay(config, records, out_dir, plot=plot, wall_s=time.perf_counter() - started)


def report_replay(
    config: ReplayConfig,
    records: dict[str, ModeRecords],
    out_dir: Path,
    *,
    plot: bool = True,
    wall_s: float = 0.0,
) -> ReplayResult:
    """Measure recorded modes and write DIR/replay.json, DIR/replay.md (and DIR/replay.png)."""
    figures = {mode: measure(r.to_json()) for mode, r in records.items()}
    result = ReplayResult(config, figures, records)
    summary = result.summary()
    summary["wall_seconds"] = round(wall_s, 1)
    (out_dir / "replay.json").write_bytes(
        orjson.dumps(summary, option=orjson.OPT_INDENT_2, default=_jsonable)
    )
    from rolloutgate.bench.replay_report import markdown_report

    (out_dir / "replay.md").write_text(markdown_report(result))
    if plot:
        from rolloutgate.bench.replay_plot import draw

        draw(result, out_dir / "replay.png")
    return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")
