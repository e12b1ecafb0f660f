"""Every core of the node: `python -m benchmarks.perf.cores` (`make bench-cores`; docs/benchmarks.md).

Theory of operation: nothing is pinned: each server runs as a user runs it, and the kernel spreads them over
the machine's CPUs. One simulator process serves two engines (the `fast` profile: no simulated time passes;
16 tokens an answer); every gateway fronts both: rolloutgate as one process, rolloutgate with `--processes N`
(default: one per CPU), and the SGLang Model Gateway's releases (`sglang-router`, `smg`; round robin) where
`make bench-tools` installed them. wrk (1 thread) drives each target in turn, interleaved over rounds, so a
change in the machine's load hits every target alike; a cell's CPU is the target's whole process tree's.

Shapes: `/generate` and `/v1/chat/completions` (with the engines' model name) non-streaming at 32
connections (req/s, CPU per request), and `/generate` at one connection (p50, and what it adds over the engine
alone in the same round).

The hop: wrk at one child's own port of the `--processes N` gateway, (a) without a routing key: served there;
(b) with a key that another child owns: every request takes the one local hop. (b) - (a), in CPU per request
of all the gateway's processes and in p50, is the cost of a hop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.kit.proc import cpu_count, cpu_seconds, machine_description, rss_bytes
from benchmarks.kit.servers import (
    ROUTERS,
    ManagedProcess,
    installed_router,
    router_version,
    start_gateway,
    start_router,
    start_sim,
)
from benchmarks.perf.load import LoadResult, run_load, wrk_installed
from benchmarks.perf.throughput import OUTPUT_TOKENS, request_body

__all__ = ("main",)

KEY_HEADER = "X-SMG-Routing-Key"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    path: str
    body: dict[str, Any]
    connections: int


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    process: ManagedProcess
    url: str
    headers: Mapping[str, str] | None = None


def shapes(model: str) -> list[Shape]:
    generate = request_body(streaming=False)  # make bench's throughput body
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": OUTPUT_TOKENS}
    return [
        Shape("/generate, 32 connections", "/generate", generate, 32),
        Shape("chat, 32 connections", "/v1/chat/completions", chat, 32),
        Shape("/generate, 1 connection", "/generate", generate, 1),
    ]


def measure(target: Target, shape: Shape, duration_s: float) -> dict[str, Any]:
    before = cpu_seconds(target.process.pid)
    load: LoadResult = run_load(
        target.url + shape.path,
        shape.body,
        connections=shape.connections,
        duration_s=duration_s,
        cpus=None,
        use_wrk=True,
        headers=target.headers,
    )
    cpu_s = cpu_seconds(target.process.pid) - before
    return {
        "target": target.name,
        "shape": shape.name,
        "rps": load.rps,
        "p50_ms": load.p50_ms,
        "p99_ms": load.p99_ms,
        "failed": load.failures,
        "cpu_us_per_req": 1e6 * cpu_s / max(1, load.requests),
        "cores": cpu_s / load.seconds if load.seconds else float("nan"),
    }


def hop_targets(gateway: ManagedProcess) -> list[Target]:
    """One child's own URL, without a key and with a key another child owns (module docstring)."""
    state = httpx.get(gateway.url + "/admin/state", timeout=10).json()
    replicas: dict[str, str] = state["fleet"]["replicas"]
    here_id, here_url = sorted(replicas.items())[0]
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    for index in range(256):  # bounded: with N owners, a key lands elsewhere with probability 1 - 1/N
        key = f"hop-{index}"
        answer = httpx.post(here_url + "/generate", json=body, headers={KEY_HEADER: key}, timeout=10)
        if answer.headers.get("X-Rolloutgate-Replica") not in (None, here_id):
            return [
                Target("served where it lands", gateway, here_url),
                Target("one hop to its owner", gateway, here_url, {KEY_HEADER: key}),
            ]
    raise RuntimeError("no routing key owned by another process in 256 tries")


def median_rows(cells: list[dict[str, Any]], engine_p50: dict[int, float]) -> list[dict[str, Any]]:
    rows = []
    keys = list(dict.fromkeys((c["shape"], c["target"]) for c in cells))
    for shape, target in keys:
        mine = [c for c in cells if c["shape"] == shape and c["target"] == target]
        row: dict[str, Any] = {"shape": shape, "target": target}
        for field in ("rps", "p50_ms", "p99_ms", "cpu_us_per_req", "cores"):
            row[field] = statistics.median(c[field] for c in mine)
        row["failed"] = sum(c["failed"] for c in mine)
        if "1 connection" in shape and target != "engine":
            row["added_p50_ms"] = statistics.median(c["p50_ms"] - engine_p50[c["round"]] for c in mine)
        rows.append(row)
    return rows


def ratios(rows: list[dict[str, Any]], mine: str, peers: list[str]) -> list[str]:
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows if "32 connections" in r["shape"]):
        by_target = {r["target"]: r for r in rows if r["shape"] == shape}
        for peer in peers:
            if mine in by_target and peer in by_target:
                ratio = by_target[mine]["rps"] / by_target[peer]["rps"]
                lines.append(f"- {shape}: {mine} req/s x{ratio:.2f} {peer}'s")
    return lines


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| shape | target | req/s | p50 ms | p99 ms | added p50 ms | CPU us/req | cores | failed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        added = f"{r['added_p50_ms']:+.2f}" if "added_p50_ms" in r else ""
        out.append(
            f"| {r['shape']} | {r['target']} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added} | "
            f"{r['cpu_us_per_req']:.0f} | {r['cores']:.2f} | {r['failed']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=cpu_count(), help="of the many-process gateway")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--out-dir", default="out/bench")
    args = parser.parse_args(argv)
    if not wrk_installed():
        print("wrk is not installed: `make bench-tools` installs it")
        return 2
    started_at = time.strftime("%Y%m%d-%H%M%S")
    sim = start_sim(None, engines=2)
    engines = sim.extra_urls
    processes: list[ManagedProcess] = [sim]
    try:
        one = start_gateway(None, engines)
        many = start_gateway(None, engines, extra_args=["--processes", str(args.processes)])
        processes += [one, many]
        many_name = f"rolloutgate --processes {args.processes}"
        targets = [
            Target("engine", sim, engines[0]),
            Target("rolloutgate", one, one.url),
            Target(many_name, many, many.url),
        ]
        versions = {}
        for kind in ROUTERS.values():
            python = installed_router(kind, log=print)
            if python is None:
                continue
            router = start_router(None, engines, python, kind=kind)
            processes.append(router)
            targets.append(Target(kind.name, router, router.url))
            versions[kind.name] = router_version(python, kind)
        model = httpx.get(engines[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        hops = hop_targets(many)
        idle_rss = {t.name: rss_bytes(t.process.pid) / 1e6 for t in targets if t.process is not sim}
        for target in targets:  # warm each, as the matrix's first cells would otherwise do
            run_load(
                target.url + "/generate",
                shapes(model)[0].body,
                connections=32,
                duration_s=1,
                cpus=None,
                use_wrk=True,
            )
        cells: list[dict[str, Any]] = []
        engine_p50: dict[int, float] = {}
        for round_index in range(args.rounds):
            for shape in shapes(model):
                for target in targets:
                    if target.name == "engine" and shape.connections != 1:
                        continue  # the engine alone is the reference of the added latency only
                    cell = {"round": round_index, **measure(target, shape, args.duration)}
                    if target.name == "engine":
                        engine_p50[round_index] = cell["p50_ms"]
                    cells.append(cell)
                    print(
                        f"round {round_index + 1} {shape.name:<26} {target.name:<28} {cell['rps']:8,.0f} req/s "
                        f"p50 {cell['p50_ms']:6.2f} ms  {cell['cpu_us_per_req']:5.0f} us/req  failed {cell['failed']}",
                        flush=True,
                    )
            for target in hops:
                shape = Shape(f"hop cost ({many_name})", "/generate", shapes(model)[0].body, 32)
                cell = {"round": round_index, **measure(target, shape, args.duration)}
                cells.append(cell)
                print(
                    f"round {round_index + 1} {target.name:<28} {cell['rps']:8,.0f} req/s {cell['cpu_us_per_req']:5.0f} us/req",
                    flush=True,
                )
    finally:
        for process in reversed(processes):
            process.stop()
    rows = median_rows(cells, engine_p50)
    peers = list(versions)
    summary = ratios(rows, many_name, peers) + ratios(rows, "rolloutgate", peers)
    hop_rows = [r for r in rows if r["shape"].startswith("hop cost")]
    if len(hop_rows) == 2:
        local, hop = hop_rows
        summary.append(
            f"- one hop: +{hop['cpu_us_per_req'] - local['cpu_us_per_req']:.0f} us of gateway CPU per request, "
            f"p50 {hop['p50_ms'] - local['p50_ms']:+.2f} ms at 32 connections"
        )
    machine = machine_description()
    report = {
        "command": "python -m benchmarks.perf.cores " + " ".join(argv or []),
        "started": started_at,
        "machine": machine,
        "routers": versions,
        "idle_rss_mb": idle_rss,
        "rows": rows,
        "cells": cells,
        "summary": summary,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cores-{started_at}.json"
    path.write_text(json.dumps(report, indent=1))
    print(table(rows))
    print("\n".join(summary))
    print(f"idle RSS MB (process tree): {idle_rss}")
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
