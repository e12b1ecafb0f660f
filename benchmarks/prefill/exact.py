"""Prefill-aware admission off and on, in the exact world: the incident replay's workload in virtual time.

    make prefill-exact
    python -m benchmarks.prefill.exact [--seeds 0-39] [--workers 2] [--out out/prefill-exact]

Theory of operation
-------------------
The HTTP comparison (benchmarks/prefill/replay.py) runs real gateways against real HTTP engines in scaled real time,
so each run carries noise of its own and 7 seeds take 13 minutes. Here each run is the gateway's sans-IO core
coupled directly to the simulator's engine model (benchmarks/prefill/exact_world.py): no HTTP, no real time, exactly
repeatable, a few seconds each, so the off/on difference can be measured on many seeds and given a confidence
interval. Same agents, storms, engines and seed as the replay's engine-time mode, without the weight update and
the freeze (only admission differs). `off` and `on` are the gateway settings prefill/replay.py uses
(prefill_measure.MODE_SETTINGS).

Figures: those of benchmarks/prefill/measure.py (one definition for every benchmark), per run, then pooled over the
seeds as prefill/replay.py pools them (rates and percentiles over all the runs' generations and turns). Plus:

- the most long prefills (uncached >= the contention threshold, as the engine counted its cache) in flight on
  one engine at once, from dispatch to first token: what the prefill budget bounds;
- a paired bootstrap over seeds: the seeds are resampled with replacement (both modes of a seed together) and
  each figure's relative change recomputed on the resample; the 2.5th and 97.5th percentiles of those changes
  are the 95% interval. A change whose interval excludes 0 is not seed noise.

Outputs in `--out`: `prefill_exact.json` (every figure per seed and pooled, the intervals) and
`prefill_exact.md` (the tables).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.kit.stats import mean, percentile
from benchmarks.prefill.exact_world import ExactRecords, run_exact
from benchmarks.prefill.measure import (
    MODES,
    PERCENTILES,
    Row,
    decode_during_storms,
    generations_of,
    held_spans,
    json_safe,
    last_attempts,
    parse_seeds,
    per_seed_lines,
    pool,
    shared_figures,
    table,
    turn_times,
)
from benchmarks.prefill.replay import ROWS as REPLAY_ROWS
from rolloutgate.core.config import GatewayCoreConfig
from rolloutreplay.scenario import ReplayConfig

__all__ = (
    "BOOTSTRAP_FIGURES",
    "ROWS",
    "bootstrap_changes",
    "main",
    "max_long_prefills_at_once",
    "measure",
    "pool_runs",
    "run_seeds",
)

LONG_PREFILL_TOKENS = GatewayCoreConfig().contention_min_prefill_tokens
_REPLAY_KEYS = {
    "colocated_decode_rate_mean",
    "colocated_decode_rate_pooled",
    "tokens_per_s",
    "turn_latency_p99_s",
    "turn_latency_p50_s",
    "uncharged_contention_s",
    None,
    "storm_span_s",
}
ROWS: tuple[Row, ...] = (
    *(row for row in REPLAY_ROWS if row[1] in _REPLAY_KEYS),
    ("warm turns: time to first token p99 (s)", "warm_turn_ttft_p99_s", "{:.1f}"),
    ("long prefills in flight on one engine at once, most", "long_prefills_at_once", "{:d}"),
)
_PERCENTILES = {**PERCENTILES, "warm_turn_ttft_p99_s": ("warm_ttft", 99)}


def max_long_prefills_at_once(generations: Sequence[dict[str, Any]], run_end: float) -> int:
    """The most generations with >= LONG_PREFILL_TOKENS uncached tokens (engine side) in prefill on one engine
    at once, each from its submission to its first token (or its end). One the engine had not yet admitted
    by the end of the run is left out: its cached tokens are not known (it waits in the engine's queue)."""
    edges: list[tuple[int, float, int]] = []
    for g in generations:
        if g["started_at"] is None or g["prompt_tokens"] - g["cached_tokens"] < LONG_PREFILL_TOKENS:
            continue
        end = g["first_token_at"] if g["first_token_at"] is not None else g["finished_at"] or run_end
        if end > g["submitted_at"]:
            edges += [(g["engine"], g["submitted_at"], 1), (g["engine"], end, -1)]
    edges.sort()  # per engine, by time; an end (-1) before a start (+1) at the same moment
    most, engine, count = 0, None, 0
    for e, _, step in edges:
        if e != engine:
            engine, count = e, 0
        count += step
        most = max(most, count)
    return most


def measure(records: ExactRecords) -> dict[str, Any]:
    """The figures of one run (one seed, one mode)."""
    run_end = records.ended_at
    generations = generations_of(records.generations, run_end)
    by_request = last_attempts(generations)
    request_of = {t["tag"]: t["request_ids"][-1] for t in records.turns}
    storms = [(s["wave"], s["at"], s["sessions"]) for s in records.storms]
    spans, latencies, warm_ttft = turn_times(records.turns, request_of, by_request, storms, run_end)
    decode = decode_during_storms(spans, generations, held=held_spans(records.holds, run_end))
    return {
        "mode": records.mode,
        "seed": records.config["seed"],
        **shared_figures(
            spans=spans,
            decode=decode,
            latencies=latencies,
            warm_ttft=warm_ttft,
            tokens_per_s=sum(g["completion_tokens"] for g in records.generations) / run_end,
            contention=records.contention_s,
            completed=len(latencies),
            failed=sum(1 for t in records.turns if t["ok"] is False),
        ),
        "long_prefills_at_once": max_long_prefills_at_once(records.generations, run_end),
    }


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs pooled (prefill_measure.pool); the most long prefills at once is the most of any run."""
    out = pool(runs, _PERCENTILES)
    out["long_prefills_at_once"] = max(f["long_prefills_at_once"] for f in runs)
    out["seeds"] = [f["seed"] for f in runs]
    out.pop("seed", None)
    return out


# figure -> how it is computed over a set of runs (the pooled definition above), for the bootstrap
BOOTSTRAP_FIGURES: dict[str, Callable[[Sequence[dict[str, Any]]], float]] = {
    "turn_latency_p99_s": lambda runs: percentile([x for f in runs for x in f["raw"]["latencies"]], 99),
    "turn_latency_p50_s": lambda runs: percentile([x for f in runs for x in f["raw"]["latencies"]], 50),
    "tokens_per_s": lambda runs: mean([f["tokens_per_s"] for f in runs]),
    "colocated_decode_rate_mean": lambda runs: mean([x for f in runs for x in f["raw"]["rates"]]),
}


def bootstrap_changes(
    per_mode: dict[str, list[dict[str, Any]]], *, resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """Each BOOTSTRAP_FIGURES figure's relative change off -> on (a fraction), with a paired bootstrap 95%
    interval over seeds: {figure: {"change", "low", "high"}}. Deterministic for a given `seed`."""
    off, on = per_mode["off"], per_mode["on"]
    if len(off) != len(on) or not off:
        raise ValueError("the bootstrap needs both modes of the same seeds")
    rng = random.Random(seed)
    draws = [[rng.randrange(len(off)) for _ in off] for _ in range(resamples)]
    out: dict[str, dict[str, float]] = {}
    for name, figure in BOOTSTRAP_FIGURES.items():
        changes = sorted(
            _relative(figure([off[i] for i in draw]), figure([on[i] for i in draw])) for draw in draws
        )
        out[name] = {
            "change": _relative(figure(off), figure(on)),
            "low": percentile(changes, 2.5),
            "high": percentile(changes, 97.5),
        }
    return out


def _relative(off: float, on: float) -> float:
    return (on - off) / off


_BOOTSTRAP_LABELS = {
    "turn_latency_p99_s": "turn latency p99",
    "turn_latency_p50_s": "turn latency p50",
    "tokens_per_s": "total tokens per second",
    "colocated_decode_rate_mean": "co-located decode rate during storms, mean",
}


def bootstrap_table(changes: dict[str, dict[str, float]], seeds: int) -> str:
    lines = [f"| on vs off, pooled ({seeds} seeds) | change | paired bootstrap 95% interval |"]
    lines.append("| --- | ---: | ---: |")
    for name, c in changes.items():
        interval = f"{100 * c['low']:+.1f}% .. {100 * c['high']:+.1f}%"
        lines.append(f"| {_BOOTSTRAP_LABELS[name]} | {100 * c['change']:+.1f}% | {interval} |")
    return "\n".join(lines)


def _run_one(job: tuple[ReplayConfig, str, int, bool]) -> dict[str, Any]:
    config, mode, progress_every, weight_update = job
    records = run_exact(config, mode, progress_every_tokens=progress_every, weight_update=weight_update)
    return measure(records)


def run_seeds(
    config: ReplayConfig,
    seeds: Sequence[int],
    *,
    workers: int = 1,
    progress_every_tokens: int = 64,
    weight_update: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Every seed off and on (`workers` processes, 1: in this process); the runs' figures by mode, in seed
    order."""
    jobs = [
        (replace(config, seed=s), mode, progress_every_tokens, weight_update) for s in seeds for mode in MODES
    ]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as executor:
            results = list(executor.map(_run_one, jobs))
    else:
        results = [_run_one(job) for job in jobs]
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for figures in results:
        per_mode[figures["mode"]].append(figures)
    return per_mode


def main(argv: list[str] | None = None) -> int:
    defaults = ReplayConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill.exact", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seeds", default="0-39", help="workload seeds: 0-39, 0,1,2 or a mix (default 0-39)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (1: this process)")
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="simulated seconds")
    parser.add_argument("--progress-every", type=int, default=64, help="tokens per progress report")
    parser.add_argument(
        "--weight-update",
        action="store_true",
        help="include the replay's weight update (gate closed, engines paused in place, caches flushed)",
    )
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, default=Path("out/prefill-exact"))
    args = parser.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    if not seeds:
        parser.error("--seeds needs at least one seed")
    config = replace(defaults, agents=args.agents, duration_s=args.duration)
    started = time.perf_counter()
    per_mode = run_seeds(
        config,
        seeds,
        workers=args.workers,
        progress_every_tokens=args.progress_every,
        weight_update=args.weight_update,
    )
    wall_s = time.perf_counter() - started
    figures = {m: pool_runs(per_mode[m]) for m in MODES}
    text = table(figures, ROWS)
    changes = bootstrap_changes(per_mode, resamples=args.resamples)
    intervals = bootstrap_table(changes, len(seeds))
    per_seed = per_seed_lines(per_mode)
    print(
        f"{len(seeds)} seed(s), off and on{', with the weight update' if args.weight_update else ''}, "
        f"{wall_s:.0f} s of real time ({args.workers} worker(s))\n\n"
        f"{text}\n\n{intervals}\n\n{per_seed}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "config": config.to_json(),
        "seeds": seeds,
        "workers": args.workers,
        "progress_every_tokens": args.progress_every,
        "weight_update": args.weight_update,
        "wall_s": round(wall_s, 1),
        "figures": {m: {k: v for k, v in f.items() if k != "raw"} for m, f in figures.items()},
        "bootstrap": changes,
        "per_seed": {
            m: [{k: v for k, v in f.items() if k != "raw"} for f in runs] for m, runs in per_mode.items()
        },
    }
    (args.out / "prefill_exact.json").write_text(json.dumps(json_safe(result), indent=2))
    (args.out / "prefill_exact.md").write_text(f"{text}\n\n{intervals}\n\n{per_seed}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
