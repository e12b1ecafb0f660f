"""`rolloutgate replay incident`: the incident replayed side by side, engine time vs wallclock.

    rolloutgate replay incident [--time-scale S] [--agents N] [--duration D] [--out DIR] [--sessions]
    rolloutgate replay trace FILE [--timeout S] [--stall-timeout S] [--set NAME=VALUE] [--out DIR]

`replay trace` runs a recorded trace's workload instead (`rolloutgate serve --record-trace FILE`; its agents,
engines and duration come from the trace).

Prints a progress bar while both modes run, then the table of figures and the verdicts; writes
DIR/replay.json, DIR/replay.png and the raw records (see run.py and docs/replay.md).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rolloutreplay.scenario import MODES, ReplayConfig

__all__ = ("add_arguments", "run")

SCENARIOS = ("incident", "trace")  # trace: a recorded trace's workload (rolloutreplay/trace_workload.py)
_DEFAULTS = ReplayConfig()


# the ReplayConfig fields set from the command line: flag, field, type, help
_CONFIG_FLAGS = (
    ("--time-scale", "time_scale", float, "simulated seconds per real second"),
    ("--agents", "agents", int, "agents"),
    ("--duration", "duration_s", float, "simulated seconds"),
    ("--engines", "engines", int, "engines"),
    ("--seed", "seed", int, "workload seed"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("scenario", choices=SCENARIOS, help="the scenario to replay")
    add(
        "file",
        nargs="?",
        type=Path,
        help="trace: the trace to replay (rolloutgate serve --record-trace FILE)",
    )
    for flag, name, kind, text in _CONFIG_FLAGS:
        default = getattr(_DEFAULTS, name)
        metavar = flag[2:].upper().replace("-", "_")
        add(
            flag, type=kind, default=default, dest=name, metavar=metavar, help=f"{text} (default {default:g})"
        )
    add("--out", type=Path, default=Path("out/replay"), help="output folder (default out/replay)")
    add("--sessions", action="store_true", help="agents use the gateway's session API (/sessions/{id}/v1)")
    add(
        "--max-seq-len",
        type=int,
        metavar="TOKENS",
        help="session token budgets: each session carries this max_seq_len (docs/rl.md; default none)",
    )
    add(
        "--groups",
        action="store_true",
        help="each storm wave is one GRPO group: one shared prompt, one X-Rolloutgate-Group (docs/rl.md)",
    )
    add(
        "--version-faults",
        action="store_true",
        help="at the update one engine's update fails, after it another engine restarts onto its launch "
        "weights; the engine-time gateway runs --version-policy latest-only (docs/rl.md)",
    )
    add(
        "--on-update-failure",
        choices=("keep", "exclude", "rollback"),
        help="the engine-time update's on_failure (default: none sent, the gateway's own default; keep: the "
        "engine whose update failed serves on, on its old weights, what the update found running there)",
    )
    add(
        "--no-prefill-admission",
        action="store_true",
        help="engine-time gateway without prefill-aware admission, as before it (docs/prefill.md)",
    )
    add("--modes", default=",".join(MODES), help="modes to run (default engine,wallclock)")
    add(
        "--in-process",
        action="store_true",
        help="run the modes in this process (one core) instead of one each",
    )
    add("--no-plot", action="store_true", help="skip the PNG")
    _add_trace_arguments(parser)
    add("--check", action="store_true", help="exit 1 if a verdict does not hold")


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """Trace capture and replay (docs/replay.md), and the gateway settings to try on a workload."""
    add = parser.add_argument
    add(
        "--record-trace",
        action="store_true",
        help="each mode's gateway records its trace: OUT/trace-engine.jsonl, OUT/trace-wallclock.jsonl",
    )
    add("--timeout", type=float, help="the gateway's timeout (default the trace's, or 600)")
    add("--stall-timeout", type=float, help="the gateway's stall_timeout (default the trace's, or 60)")
    add("--client-timeout", type=float, help="the agents' LiteLLM timeout (default 300)")
    add(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other gateway setting, as rolloutgate serve's flag would give it (repeatable)",
    )


def _config(args: argparse.Namespace) -> ReplayConfig:
    given = {
        name: value
        for name, value in (
            ("gateway_timeout_s", args.timeout),
            ("stall_timeout_s", args.stall_timeout),
            ("client_timeout_s", args.client_timeout),
        )
        if value is not None
    }
    given["gateway_settings"] = tuple(_setting(text) for text in args.set)
    if args.record_trace:
        given["record_trace"] = str(args.out)
    if args.max_seq_len is not None:
        given["max_seq_len"] = args.max_seq_len
    common = {
        "sessions": args.sessions,
        "groups": args.groups,
        "prefill_admission": not args.no_prefill_admission,
        "version_faults": args.version_faults,
        "update_on_failure": args.on_update_failure,
    }
    if args.scenario == "trace":
        from rolloutreplay.trace_workload import trace_config

        if args.file is None:
            raise ValueError("replay trace takes the trace's file: rolloutgate replay trace FILE")
        if args.version_faults:
            raise ValueError("--version-faults is for the incident scenario (a trace brings its own events)")
        replay = {"time_scale": args.time_scale, "seed": args.seed}
        return trace_config(args.file, **replay, **common, **given)
    return ReplayConfig(**{name: getattr(args, name) for _, name, _, _ in _CONFIG_FLAGS}, **common, **given)


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--set takes NAME=VALUE, got {text!r}")
    return name.strip().replace("-", "_"), value.strip()


def run(args: argparse.Namespace) -> int:
    from rolloutreplay.report import print_report
    from rolloutreplay.run import run_replay

    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    try:
        config = _config(args)
    except (ValueError, OSError) as exc:  # TraceError is a ValueError
        raise SystemExit(f"rolloutgate replay: {exc}") from exc
    console = Console()
    console.print(
        f"replaying {'the incident' if config.trace is None else config.trace}: {config.agents} agents on "
        f"{config.engines} simulated SGLang engines, "
        f"{config.duration_s:.0f} simulated s at x{config.time_scale:g} (~{config.real_s(config.duration_s):.0f} s), "
        f"modes: {', '.join(modes)}"
    )
    with Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.fields[now]:>6.0f}/{task.total:.0f} s"),
        TextColumn("{task.fields[turns]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks = {
            mode: bar.add_task(mode, total=config.duration_s, now=0.0, turns="starting (imports LiteLLM)")
            for mode in modes
        }

        def progress(state: dict[str, Any]) -> None:
            task = tasks.get(str(state.get("mode")))
            if task is not None:
                turns = f"{state['turns_ok']} turns ok, {state['turns_failed']} failed"
                bar.update(task, completed=float(state["now"]), now=float(state["now"]), turns=turns)

        result = asyncio.run(
            run_replay(
                config,
                args.out,
                modes=modes,
                in_process=args.in_process,
                progress=progress,
                plot=not args.no_plot,
            )
        )
    print_report(result, console)
    console.print(f"written: {args.out}/replay.json" + ("" if args.no_plot else f", {args.out}/replay.png"))
    return 1 if args.check and not result.passed else 0
