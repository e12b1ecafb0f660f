"""The RL shape run: its flags (`--rl-shape-*`, `--quick`), the engines started once, each path's gateway
started and stopped around its phase, and the result written as JSON (NaN as null) beside the report."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.kit.proc import cpu_count, machine_description
from benchmarks.kit.servers import (
    ROUTERS,
    ManagedProcess,
    installed_router,
    router_version,
    set_log_dir,
    start_gateway,
    start_router,
    start_sim,
)
from benchmarks.perf.report import command_line
from benchmarks.perf.report import format_value as fmt
from benchmarks.perf.rl_shape.engines import engine_flags
from benchmarks.perf.rl_shape.measure import run_phase
from benchmarks.perf.rl_shape.phase import PhaseResult
from benchmarks.perf.rl_shape.plan import (
    DEFAULT,
    MINE,
    PATHS,
    QUICK,
    ROUTER_PATHS,
    ShapeOptions,
    plan_load,
    plan_summary,
)
from benchmarks.perf.rl_shape.render import render
from benchmarks.perf.rl_shape.verdict import goals, limits

__all__ = ("add_arguments", "options_from_args", "run_from_args", "run_shape")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rl-shape (`--only rl-shape`, make bench-rl)")
    add = group.add_argument
    add("--rl-shape-engines", type=int, help=f"simulated engines (default {DEFAULT.engines})")
    add("--rl-shape-running", type=int, help=f"clients per engine (default {DEFAULT.running_per_engine})")
    add("--rl-shape-slots", type=int, help=f"each engine's running slots (default {DEFAULT.engine_slots})")
    add("--rl-shape-time-scale", type=float, help=f"simulated s per real s (default {DEFAULT.time_scale:g})")
    add(
        "--rl-shape-tokens-per-worker",
        type=int,
        help=f"generated tokens each client asks for per phase (default {DEFAULT.tokens_per_worker})",
    )
    add("--rl-shape-cap", type=float, help=f"seconds per phase at most (default {DEFAULT.phase_cap_s:g})")
    add(
        "--rl-shape-router-policy",
        choices=("manual", "cache_aware", "round_robin"),
        help="the SGLang Model Gateway's policy (default manual: sticky on X-SMG-Routing-Key)",
    )
    add("--rl-shape-paths", help=f"comma-separated subset of {','.join(PATHS)} (direct is always run)")
    add("--rl-shape-seed", type=int, help="the load's seed (default 0)")
    add("--rl-shape-processes", type=int, help="`--processes` of the rolloutgate-processes path (default 2)")


def options_from_args(args: argparse.Namespace) -> ShapeOptions:
    options = QUICK if getattr(args, "quick", False) else DEFAULT
    changes: dict[str, Any] = {}
    for attr, name in (
        ("rl_shape_engines", "engines"),
        ("rl_shape_running", "running_per_engine"),
        ("rl_shape_slots", "engine_slots"),
        ("rl_shape_time_scale", "time_scale"),
        ("rl_shape_tokens_per_worker", "tokens_per_worker"),
        ("rl_shape_cap", "phase_cap_s"),
        ("rl_shape_router_policy", "router_policy"),
        ("rl_shape_seed", "seed"),
        ("rl_shape_processes", "processes"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            changes[name] = value
    paths = getattr(args, "rl_shape_paths", None)
    if paths:
        chosen = [p.strip() for p in paths.split(",") if p.strip()]
        unknown = set(chosen) - set(PATHS)
        if unknown:
            raise SystemExit(f"--rl-shape-paths: unknown {sorted(unknown)}; choose from {PATHS}")
        changes["paths"] = tuple(p for p in PATHS if p in chosen or p == "direct")
    return replace(options, **changes)


def _code_version() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
        diff = subprocess.run(["git", "diff", "HEAD"], capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    if not dirty:
        return head
    digest = hashlib.sha1(diff).hexdigest()[:10]
    return f"{head} + uncommitted changes in {len(dirty)} tracked files (git diff HEAD sha1 {digest})"


def run_shape(
    options: ShapeOptions,
    *,
    out_dir: Path,
    server_cpu: str | None,
    client_cpu: str | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); returns the result dict (also written to out_dir as JSON)."""
    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_log_dir = set_log_dir(out_dir / "logs" / f"rl-shape-{stamp}")
    try:
        return _run_shape(options, started, stamp, out_dir, server_cpu, client_cpu, log)
    finally:
        set_log_dir(previous_log_dir)


def _run_shape(
    options: ShapeOptions,
    started: float,
    stamp: str,
    out_dir: Path,
    server_cpu: str | None,
    client_cpu: str | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    routers: dict[str, Path] = {}  # the SGLang Model Gateway's releases that run: their python
    paths = list(options.paths)
    for name in ROUTER_PATHS:
        if name in paths:
            python = installed_router(ROUTERS[name], log=log)
            if python is None:
                paths.remove(name)
            else:
                routers[name] = python
    plan = plan_load(options)
    summary = plan_summary(plan)
    log(
        f"RL shape: {summary['workers']} clients, {summary['turns']} turns, {summary['sessions']} sessions, "
        f"{summary['generated_tokens']:,} tokens per phase; paths {', '.join(paths)}"
    )
    phases: dict[str, PhaseResult] = {}
    sim = start_sim(client_cpu, engines=options.engines, profile="incident", overrides=engine_flags(options))
    try:
        for name in paths:
            gateway: ManagedProcess | None = None
            try:
                if name in MINE:
                    processes = (
                        ["--processes", str(options.processes)] if name == "rolloutgate-processes" else []
                    )
                    gateway = start_gateway(
                        server_cpu,
                        sim.extra_urls,
                        extra_args=["--time-scale", f"{options.time_scale:g}", *processes],
                    )
                elif name in routers:
                    gateway = start_router(
                        server_cpu, sim.extra_urls, routers[name], options.router_policy, kind=ROUTERS[name]
                    )
                log(f"phase {name} ...")
                phase = run_phase(
                    name,
                    plan,
                    options,
                    sim=sim,
                    gateway=gateway,
                    server_cpu=server_cpu,
                    client_cpu=client_cpu,
                    log=log,
                )
            finally:
                if gateway is not None:
                    gateway.stop()
            phases[name] = phase
            s = phase.summary()
            log(
                f"  {name}: {s['turns_ok']}/{s['turns_planned']} ok, {s['failed']} failed, {s['cut']} cut in "
                f"{s['wall_s']:.1f} s; p50 {fmt(s['latency_p50_s'])} s, p99 {fmt(s['latency_p99_s'])} s; "
                f"simulator {s['sim_cores']:.2f} cores"
            )
    finally:
        sim.stop()
    summaries = {name: phase.summary() for name, phase in phases.items()}
    result: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "code": _code_version(),
            "machine": machine_description(),
            "pinning": "none: every process on every CPU"
            if server_cpu is None
            else f"gateway on CPU {server_cpu}; simulator and clients on CPU {client_cpu}",
            "client_cpu": client_cpu,
            "engine_flags": engine_flags(options),
            "rolloutgate_args": ["--time-scale", f"{options.time_scale:g}"],
            "routers": {name: router_version(python, ROUTERS[name]) for name, python in routers.items()},
        },
        "options": asdict(options) | {"concurrency": options.concurrency},
        "plan": summary,
        "phases": summaries,
    }
    result["goals"] = goals(summaries)
    result["limits"] = limits(result)
    result["meta"]["elapsed_s"] = time.time() - started
    path = out_dir / f"rl-shape-{stamp}.json"
    path.write_text(json.dumps(_finite(result), indent=1) + "\n")
    result["meta"]["json"] = str(path)
    return result


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as null (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def run_from_args(args: argparse.Namespace, *, log: Callable[[str], None] = print) -> int:
    """`python -m benchmarks.perf --only rl-shape [--quick] [--rl-shape-* ...]` (benchmarks/perf/cli.py)."""
    options = options_from_args(args)
    server_cpu = getattr(args, "server_cpu", "0")
    client_cpu = getattr(args, "client_cpu", "1")
    if cpu_count() < 2 or "none" in (server_cpu, client_cpu):  # `--server-cpu none`: every side unpinned
        server_cpu = client_cpu = None
    result = run_shape(
        options, out_dir=Path(args.out_dir), server_cpu=server_cpu, client_cpu=client_cpu, log=log
    )
    print()
    print(render(result))
    log(f"results: {result['meta']['json']}")
    return 0
