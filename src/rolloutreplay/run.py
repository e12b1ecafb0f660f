"""The incident replay: both modes side by side, measured, reported (table, JSON, PNG).

Theory of operation: `run_replay` starts one worker process per mode (worker.py), each running the same
scenario (scenario.py) against its own simulated engines and its own gateway, engine time in one,
`--clock wallclock` in the other. While they run, their progress lines drive a progress bar. Then it measures
each mode's records (measure.py), checks what the replay must show (result.py `verdicts`), and writes:

    DIR/replay.json          the figures of both modes, the verdicts, the configuration
    DIR/replay.md            the same table and verdicts in markdown
    DIR/replay.png           per-engine timelines of both modes and the waste per mode (plot.py)
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

from rolloutreplay.measure import measure
from rolloutreplay.report import markdown_report
from rolloutreplay.result import ReplayResult
from rolloutreplay.scenario import MODES, ReplayConfig
from rolloutreplay.world import ModeRecords, run_mode

__all__ = ("WorkerJob", "report_replay", "run_in_process", "run_replay", "run_workers")

Progress = Callable[[dict[str, Any]], None]


def _worker_command(config: ReplayConfig, mode: str, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rolloutreplay.worker",
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


async def run_in_process(
    jobs: Sequence[WorkerJob], out_dir: Path, progress: Progress | None = None
) -> dict[str, ModeRecords]:
    """`run_workers` in this process, on one event loop (for tests: LiteLLM is imported once)."""
    results = await asyncio.gather(*(run_mode(job.config, job.mode, progress) for job in jobs))
    records = {job.label: r for job, r in zip(jobs, results, strict=True)}
    for label, record in records.items():
        (out_dir / f"records-{label}.json").write_bytes(orjson.dumps(record.to_json()))
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
    jobs = [WorkerJob(label=m, config=config, mode=m) for m in modes]
    records = await (run_in_process if in_process else run_workers)(jobs, out_dir, progress)
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
    (out_dir / "replay.md").write_text(markdown_report(result))
    if plot:
        try:
            from rolloutreplay.plot import draw  # matplotlib (the `replay` extra): only when drawing
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise SystemExit(
                "the replay's PNG needs matplotlib: pip install 'rolloutgate[replay]' (or --no-plot)"
            ) from exc
        draw(result, out_dir / "replay.png")
    return result


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialize {type(value).__name__}")
