"""`python -m benchmarks.perf`: the gateway's performance benchmark (`make bench`; docs/benchmarks.md).

    python -m benchmarks.perf                 # everything, tables printed, JSON + docs/benchmarks.md written
    python -m benchmarks.perf --only throughput --rounds 1 --duration 3
    python -m benchmarks.perf --only profile  # py-spy on the gateway at 32 connections, both modes
    python -m benchmarks.perf --only rl-shape # miles' TITO calls: direct, rolloutgate, the router (make bench-rl)

Parts: `throughput` (the engine alone, rolloutgate and the SGLang Model Gateway side by side at 1, 32 and 256
connections, streaming and not), `inflight` (RSS with many streams open), `dispatch` (one dispatch decision
against the queue's size), `rl` (CPU per million tokens at RL scale), `profile` (py-spy summaries);
`rl-shape`, run alone (rl_shape/, `make bench-rl`): miles' long-prompt non-streaming calls, direct and
through both gateways. Every server runs in its own process; see throughput.py for the pinning.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

from benchmarks.kit.proc import cpu_count, cpu_seconds, machine_description
from benchmarks.kit.servers import (
    ROUTERS,
    ManagedProcess,
    installed_router,
    repin,
    router_version,
    set_log_dir,
    start_gateway,
    start_router,
    start_sim,
)
from benchmarks.perf import dispatch, inflight, profile, report, rl, throughput
from benchmarks.perf.load import run_load, wrk_installed
from benchmarks.perf.rl_shape import run as rl_shape

__all__ = ("add_arguments", "main", "run")

PARTS = ("throughput", "inflight", "dispatch", "rl", "profile", "rl-shape")
DEFAULT_PARTS = ("throughput", "inflight", "dispatch", "rl")
GOAL_STREAMS = 10_000


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--only",
        action="append",
        choices=PARTS,
        help=f"run only these parts (repeatable; default {DEFAULT_PARTS})",
    )
    add("--quick", action="store_true", help="tiny sizes and durations: a smoke test of the harness")
    add("--duration", type=float, default=5.0, help="seconds per throughput cell (default 5)")
    add("--rounds", type=int, default=2, help="interleaved rounds of the throughput matrix (default 2)")
    add("--connections", type=_ints, default=(1, 32, 256), help="comma-separated (default 1,32,256)")
    add("--client", choices=("auto", "wrk", "python"), default="auto", help="load generator (default auto)")
    add("--no-router", action="store_true", help="skip the SGLang Model Gateway")
    add("--server-cpu", default="0", help="CPU of the server under test (default 0)")
    add("--client-cpu", default="1", help="CPU of the load generator and the engine behind a gateway")
    add(
        "--inflight-streams",
        type=int,
        default=GOAL_STREAMS,
        help="streams to hold open (capped by the fd limit)",
    )
    add("--rl-warmup", type=float, default=20.0)
    add("--rl-window", type=float, default=30.0)
    add("--profile-duration", type=float, default=10.0)
    add("--out-dir", default="out/bench", help="JSON results and profiles (default out/bench)")
    add("--docs", default="docs/benchmarks.md", help="page whose generated block is replaced ('' = none)")
    rl_shape.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    parts = tuple(args.only) if args.only else DEFAULT_PARTS
    if "rl-shape" in parts:
        if len(set(parts)) > 1:
            _log("--only rl-shape runs alone (make bench-rl)")
            return 2
        return rl_shape.run_from_args(args, log=_log)
    if args.quick:
        args.duration, args.rounds, args.connections = 1.0, 1, (1, 8)
        args.inflight_streams = min(args.inflight_streams, 200)
        args.rl_warmup, args.rl_window, args.profile_duration = 2.0, 2.0, 2.0
    if cpu_count() < 2:
        args.server_cpu = args.client_cpu = None
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    set_log_dir(out_dir / "logs" / time.strftime("%Y%m%d-%H%M%S", time.localtime(started)))
    use_wrk = args.client != "python" and wrk_installed()
    if args.client == "wrk" and not use_wrk:
        _log("wrk is not installed: `make bench-tools` installs it (or --client python)")
        return 2
    if args.client == "auto" and not use_wrk:
        _log("wrk is not installed (`make bench-tools`): the Python load generator runs instead")
    results: dict[str, Any] = {
        "meta": {
            "command": report.command_line(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "machine": machine_description(),
            "generator": "wrk (1 thread)" if use_wrk else "python-aiohttp (loadgen.py)",
            "pinning": _pinning(args),
            "parts": list(parts),
        }
    }
    routers: dict[str, Path] = {}  # the SGLang Model Gateway's releases installed, by name: their python
    if not args.no_router and ("throughput" in parts or "inflight" in parts):
        for kind in ROUTERS.values():
            python = installed_router(kind, log=_log)
            if python is not None:
                routers[kind.name] = python
        results["meta"]["routers"] = {name: router_version(py, ROUTERS[name]) for name, py in routers.items()}
    if "throughput" in parts:
        _log("throughput and latency")
        results["throughput"] = _throughput(args, use_wrk, routers)
    if "inflight" in parts:
        _log("streams in flight")
        results["inflight"] = _inflight(args, routers)
    if "dispatch" in parts:
        _log("dispatch decision cost")
        sizes = (100, 1_000) if args.quick else (100, 1_000, 10_000, 100_000)
        costs = dispatch.run_dispatch_bench(sizes, samples=200 if args.quick else 2000)
        results["dispatch"] = [c.as_dict() for c in costs]
    if "rl" in parts:
        _log("RL progress watching")
        results["rl"] = [
            rl.run_rl(
                server_cpu=args.server_cpu,
                client_cpu=args.client_cpu,
                warmup_s=args.rl_warmup,
                window_s=args.rl_window,
                log=_log,
            ).as_dict()
        ]
    if "profile" in parts:
        _log("profiling the gateway (py-spy)")
        results["profile"] = _profile(args, use_wrk, out_dir)
    results["meta"]["elapsed_s"] = time.time() - started
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    json_path = out_dir / f"perf-{stamp}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    text = report.render(results)
    print()
    print(text)
    _log(f"results: {json_path}")
    if args.docs and not args.quick and set(DEFAULT_PARTS) <= set(parts):
        report.update_doc(Path(args.docs), text)
        _log(f"updated the generated block of {args.docs}")
    return 0


def _log(message: str) -> None:
    print(message, flush=True)


def _pinning(args: argparse.Namespace) -> str:
    if args.server_cpu is None:
        return "none (one CPU)"
    return (
        f"server under test on CPU {args.server_cpu}; load generator on CPU {args.client_cpu}; the engine on CPU "
        f"{args.server_cpu} when measured alone, on CPU {args.client_cpu} (with the load generator) behind a gateway"
    )


def _gateway_args(args: argparse.Namespace) -> list[str]:
    return []  # the gateway's defaults


def _throughput(args: argparse.Namespace, use_wrk: bool, routers: dict[str, Path]) -> dict[str, Any]:
    sim = start_sim(args.client_cpu)
    started: list[ManagedProcess] = [sim]
    try:
        gateway = start_gateway(args.server_cpu, [sim.url], extra_args=_gateway_args(args))
        started.append(gateway)
        targets = [
            throughput.Target(name="engine", process=sim, url=sim.url, engine_cpu=args.server_cpu),
            throughput.Target(
                name="engine (client CPU)", process=sim, url=sim.url, engine_cpu=args.client_cpu
            ),
            throughput.Target(
                name="rolloutgate", process=gateway, url=gateway.url, engine_cpu=args.client_cpu
            ),
        ]
        for name, python in routers.items():
            router = start_router(args.server_cpu, [sim.url], python, kind=ROUTERS[name])
            started.append(router)
            targets.append(
                throughput.Target(name=name, process=router, url=router.url, engine_cpu=args.client_cpu)
            )
        if args.server_cpu is None:
            targets = [t for t in targets if t.name != "engine (client CPU)"]
        idle = throughput.idle_rss([p for p in started if p is not sim])
        options = throughput.MatrixOptions(
            connections=args.connections,
            rounds=args.rounds,
            duration_s=args.duration,
            client_cpu=args.client_cpu,
            use_wrk=use_wrk,
            log=_log,
        )
        cells = throughput.run_matrix(targets, sim, options)
    finally:
        for process in reversed(started):
            process.stop()
    return {
        "output_tokens": throughput.OUTPUT_TOKENS,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "gateway_args": _gateway_args(args),
        "idle_rss_mb": {name: rss / 1e6 for name, rss in idle.items()},
        "rows": throughput.summarize_matrix(cells),
        "cells": [c.as_dict() for c in cells],
    }


def _inflight(args: argparse.Namespace, routers: dict[str, Path]) -> dict[str, Any]:
    inflight.raise_fd_limit(2 * args.inflight_streams + 1000)
    limit = inflight.max_streams_for_fd_limit()
    high = min(args.inflight_streams, limit)
    counts = sorted({max(1, high // 2), high})
    measurements: list[inflight.InflightResult] = []
    for name in ("rolloutgate", *routers):
        for count in counts if name == "rolloutgate" else [high]:
            sim = start_sim(args.client_cpu, profile="default", overrides=inflight.SLOW_ENGINE_FLAGS)
            server: ManagedProcess | None = None
            try:
                if name == "rolloutgate":
                    server = start_gateway(
                        args.server_cpu, [sim.url], extra_args=["--capacity", str(args.inflight_streams)]
                    )
                else:
                    server = start_router(args.server_cpu, [sim.url], routers[name], kind=ROUTERS[name])
                measurements.append(
                    inflight.measure_inflight(server, sim.url, count, client_cpu=args.client_cpu, log=_log)
                )
            finally:
                if server is not None:
                    server.stop()
                sim.stop()
    mine = [m for m in measurements if m.target == "rolloutgate"]
    rss_at_goal = None
    if mine:
        if mine[-1].streams >= args.inflight_streams:
            rss_at_goal = mine[-1].rss_bytes / 1e6
        elif len(mine) >= 2:
            rss_at_goal = inflight.extrapolate(mine[0], mine[-1], args.inflight_streams) / 1e6
    return {
        "decode_s": inflight.DECODE_S,
        "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "goal_streams": args.inflight_streams,
        "measured_at_goal": bool(mine) and mine[-1].streams >= args.inflight_streams,
        "rss_at_goal_mb": rss_at_goal,
        "measurements": [m.as_dict() for m in measurements],
    }


def _profile(args: argparse.Namespace, use_wrk: bool, out_dir: Path) -> dict[str, Any]:
    if profile.py_spy_path() is None:
        _log("py-spy is not installed (pip install -e '.[bench]'): no profile")
        return {}
    sim = start_sim(args.client_cpu)
    gateway: ManagedProcess | None = None
    summaries: dict[str, Any] = {}
    try:
        gateway = start_gateway(args.server_cpu, [sim.url], extra_args=_gateway_args(args))
        repin(sim.pid, args.client_cpu)
        for streaming in (False, True):
            mode = "stream" if streaming else "plain"
            body = throughput.request_body(streaming)
            url = gateway.url + "/generate"
            run_load(url, body, connections=32, duration_s=1, cpus=args.client_cpu, use_wrk=use_wrk)
            raw_path = out_dir / f"profile-{mode}.raw"
            recorder = profile.record(gateway.pid, raw_path, duration_s=args.profile_duration)
            cpu_before = cpu_seconds(gateway.pid)
            load = run_load(
                url,
                body,
                connections=32,
                duration_s=args.profile_duration + 1,
                cpus=args.client_cpu,
                use_wrk=use_wrk,
            )
            cpu_per_1k = 1000 * (cpu_seconds(gateway.pid) - cpu_before) / max(1, load.requests)
            if recorder is not None:
                recorder.wait(timeout=args.profile_duration + 60)
            summary = profile.summarize(raw_path.read_text() if raw_path.exists() else "")
            text = summary.render(
                f"rolloutgate, {mode}, 32 connections, {load.rps:,.0f} req/s, "
                f"{cpu_per_1k:.3f} CPU-s per 1k requests (py-spy attached)"
            )
            (out_dir / f"profile-{mode}.md").write_text(text + "\n")
            print(text)
            summaries[mode] = {
                "rps": load.rps,
                "cpu_s_per_1k_requests": cpu_per_1k,
                "samples": summary.samples,
                "self_top": summary.self_top,
                "inclusive_top": summary.inclusive_top,
            }
    finally:
        if gateway is not None:
            gateway.stop()
        sim.stop()
    summaries["rl"] = _profile_rl(args, out_dir)
    return summaries


def _profile_rl(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """py-spy on the gateway under the RL load (non-streaming clients)."""
    raw_path = out_dir / "profile-rl.raw"
    result = rl.run_rl(
        server_cpu=args.server_cpu,
        client_cpu=args.client_cpu,
        warmup_s=min(args.rl_warmup, 15.0),
        window_s=args.profile_duration,
        log=_log,
        profile_out=raw_path,
    )
    summary = profile.summarize(raw_path.read_text() if raw_path.exists() else "")
    text = summary.render(
        f"rolloutgate, RL load, {result.tokens_per_s:,.0f} tok/s, "
        f"{result.cpu_s_per_million_tokens:.2f} CPU-s per million tokens (py-spy attached)"
    )
    (out_dir / "profile-rl.md").write_text(text + "\n")
    print(text)
    return {
        "tokens_per_s": result.tokens_per_s,
        "cpu_s_per_million_tokens": result.cpu_s_per_million_tokens,
        "samples": summary.samples,
        "self_top": summary.self_top,
        "inclusive_top": summary.inclusive_top,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.perf [flags]`: the flags `add_arguments` registers."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.perf", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
