"""Throughput and latency side by side: the engine alone, rolloutgate, and the SGLang Model Gateway (`sglang-router`,
as miles pins it, and `smg`, its newest release).

Theory of operation: one simulated engine (`fast` profile: no simulated time passes, 16 output tokens per
request) serves every cell. A cell is one load generator run (C connections, D seconds, the same POST
`/generate` body, streaming or not) against one target; the target's CPU seconds are read from /proc around
it. Cells are interleaved (for each round, for each connection count and mode, every target in turn), so a
change of the machine's background load hits the three targets alike; each figure is the median over rounds
and each ratio is computed within a round, then the median taken.

Pinning with two CPUs (`server_cpu`, `client_cpu`): the server under test runs alone on `server_cpu`; the load
generator runs on `client_cpu`. The engine is moved between cells: on `server_cpu` when it is the target
itself (the engine alone, as the peers measured it), on `client_cpu` next to the load generator when a gateway
is the target, so the gateway never shares its CPU with the engine. Both gateways get the same CPU. The
`engine (client CPU)` row measures the engine where it sits during gateway cells: the ceiling no gateway row
can pass.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.kit.proc import cpu_seconds, rss_bytes
from benchmarks.kit.servers import ManagedProcess, repin
from benchmarks.perf.load import LoadResult, run_load

__all__ = ("OUTPUT_TOKENS", "Cell", "Target", "request_body", "run_matrix", "summarize_matrix")

OUTPUT_TOKENS = 16  # max_new_tokens of every request; the fast profile always generates them all


def request_body(streaming: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(range(11, 27)),
        "sampling_params": {"max_new_tokens": OUTPUT_TOKENS},
    }
    if streaming:
        body["stream"] = True
    return body


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    name: str  # "engine", "engine (client CPU)", "rolloutgate", "sglang-router", "smg"
    process: ManagedProcess  # whose CPU is measured
    url: str
    engine_cpu: str | None  # where the engine sits during this target's cells


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    round: int
    target: str
    streaming: bool
    connections: int
    load: LoadResult
    cpu_s: float  # the target process's CPU seconds during the cell

    def as_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "target": self.target,
            "streaming": self.streaming,
            "connections": self.connections,
            "cpu_s": round(self.cpu_s, 4),
            **self.load.as_dict(),
        }


@dataclass(slots=True, kw_only=True)
class MatrixOptions:
    connections: tuple[int, ...] = (1, 32, 256)
    modes: tuple[bool, ...] = (False, True)  # streaming?
    rounds: int = 2
    duration_s: float = 5.0
    client_cpu: str | None = "1"
    use_wrk: bool = True
    log: Callable[[str], None] = print
    cells: list[Cell] = field(default_factory=list)


def _warm(target: Target, sim: ManagedProcess, options: MatrixOptions) -> None:
    repin(sim.pid, target.engine_cpu)
    for streaming in options.modes:
        run_load(
            target.url + "/generate",
            request_body(streaming),
            connections=32,
            duration_s=1,
            cpus=options.client_cpu,
            use_wrk=options.use_wrk,
        )


def run_matrix(targets: list[Target], sim: ManagedProcess, options: MatrixOptions) -> list[Cell]:
    """Run every cell `options.rounds` times, interleaved; returns the cells in the order they ran."""
    for target in targets:
        _warm(target, sim, options)
    cells = options.cells
    for round_index in range(options.rounds):
        for connections in options.connections:
            for streaming in options.modes:
                for target in targets:
                    repin(sim.pid, target.engine_cpu)
                    before = cpu_seconds(target.process.pid)
                    load = run_load(
                        target.url + "/generate",
                        request_body(streaming),
                        connections=connections,
                        duration_s=options.duration_s,
                        cpus=options.client_cpu,
                        use_wrk=options.use_wrk,
                    )
                    cell = Cell(
                        round=round_index,
                        target=target.name,
                        streaming=streaming,
                        connections=connections,
                        load=load,
                        cpu_s=cpu_seconds(target.process.pid) - before,
                    )
                    cells.append(cell)
                    options.log(
                        f"  round {round_index + 1} {target.name:<20} {'stream' if streaming else 'plain ':<6} "
                        f"c={connections:<4} {load.rps:8.0f} req/s  p50 {load.p50_ms:7.2f} ms  "
                        f"p99 {load.p99_ms:8.2f} ms  failed {load.failures}"
                    )
    return cells


def _median(values: list[float]) -> float:
    clean = [v for v in values if v == v]  # drop NaN
    return statistics.median(clean) if clean else float("nan")


def summarize_matrix(
    cells: list[Cell], references: tuple[str, ...] = ("sglang-router", "smg")
) -> list[dict[str, Any]]:
    """One row per (target, mode, connections): medians over rounds, CPU per 1,000 requests and per million
    generated tokens (totals over rounds), and the ratio of requests/s to each of `references` that ran
    (`ratio_to`: the median of the per-round ratios)."""
    keys: list[tuple[str, bool, int]] = []
    for cell in cells:
        key = (cell.target, cell.streaming, cell.connections)
        if key not in keys:
            keys.append(key)
    by_round: dict[tuple[str, bool, int, int], Cell] = {
        (c.target, c.streaming, c.connections, c.round): c for c in cells
    }
    rows = []
    for target, streaming, connections in keys:
        mine = [
            c for c in cells if (c.target, c.streaming, c.connections) == (target, streaming, connections)
        ]
        requests = sum(c.load.requests for c in mine)
        cpu = sum(c.cpu_s for c in mine)
        ratios: dict[str, list[float]] = {}
        for reference in references:
            for c in mine:
                ref = by_round.get((reference, streaming, connections, c.round))
                if ref is not None and ref.load.rps > 0:
                    ratios.setdefault(reference, []).append(c.load.rps / ref.load.rps)
        rows.append(
            {
                "target": target,
                "streaming": streaming,
                "connections": connections,
                "rps": _median([c.load.rps for c in mine]),
                "p50_ms": _median([c.load.p50_ms for c in mine]),
                "p99_ms": _median([c.load.p99_ms for c in mine]),
                "failures": sum(c.load.failures for c in mine),
                "cpu_s_per_1k_requests": 1000 * cpu / requests if requests else float("nan"),
                "cpu_s_per_million_tokens": 1e6 * cpu / (requests * OUTPUT_TOKENS)
                if requests
                else float("nan"),
                "cores_busy": cpu / sum(c.load.seconds for c in mine) if mine else float("nan"),
                "ratio_to": {reference: _median(values) for reference, values in ratios.items()},
                "rounds": len(mine),
            }
        )
    return rows


def idle_rss(processes: list[ManagedProcess]) -> dict[str, int]:
    return {p.name: rss_bytes(p.pid) for p in processes}
