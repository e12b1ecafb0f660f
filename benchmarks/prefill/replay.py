"""Prefill-aware admission, off and on, side by side in the incident replay (docs/prefill.md).

    make prefill-compare
    python -m benchmarks.prefill.replay [--seeds 0,1,2,3,4,5,6] [--time-scale 24] [--one-at-a-time]
                                               [--out out/prefill-replay] [--remeasure]

Theory of operation
-------------------
For each seed, the incident replay's engine-time mode (rolloutreplay/world.py: 12 agents on 4 simulated SGLang
engines, two storms of new ~100K-token sessions, a weight update, an engine that freezes for good) runs twice,
with prefill-aware admission off (the gateway as it was: session affinity, no budget, no rest) and on (the
gateway's defaults), in two worker processes started together (rolloutreplay/run.py `run_workers`), the engines
recording every token's time. Both runs of a seed face the same workload and the same scripted events; only
the gateway's admission differs.

Figures (benchmarks/prefill/measure.py defines the shared ones), per run, then pooled over the seeds: rates and
percentiles over all the runs' generations and turns, counts summed, the rest averaged per run:

- co-located decode rate during storms: engine side, from the token times; time an engine was paused (the
  weight update) or frozen is not counted;
- total tokens per second; turn latency p50 and p99 over all completed turns; uncharged contention;
- turn latency p99 *excluding the turns caught by the freeze*: a turn one of whose generations was on the
  frozen engine when it froze or was sent there after (it runs again elsewhere, after up to `stall_timeout` and
  a whole lost decode). Which turns the freeze catches depends on where the sessions happen to be, which
  placement changes: this row separates that chance from admission's doing. The headline p99 is the plain one;
- warm turns' time to first token (medium and long turns: a session's next turn; those caught by the freeze
  aside), the storms' spans;
- the replay's own engine-time verdicts (rolloutreplay/run.py `verdicts`), per run;
- the largest event-loop stall of each run: at a high time scale on a busy machine a late loop distorts the run
  (docs/replay.md, fidelity); a run whose loop fell behind by more than half of `stall_timeout` is flagged.

Outputs in `--out`: `prefill_replay.json` (every figure, per seed and pooled, the verdicts), `prefill_replay.md`
(the tables), and per seed `records-seed<N>-<off|on>.json` (the replay's raw records) and worker logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

from benchmarks.kit.stats import percentile
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
    split_rid,
    table,
    turn_times,
)
from rolloutreplay.measure import measure as measure_replay
from rolloutreplay.result import verdicts
from rolloutreplay.run import WorkerJob, run_in_process, run_workers
from rolloutreplay.scenario import ReplayConfig

__all__ = ("ROWS", "compare", "main", "measure", "prefill_config")

_PERCENTILES = {
    **PERCENTILES,
    "turn_latency_p99_unfrozen_s": ("latencies_unfrozen", 99),
    "warm_turn_ttft_p99_s": ("warm_ttft", 99),
}

ROWS: tuple[Row, ...] = (
    ("co-located decode rate during storms, mean (tok/s)", "colocated_decode_rate_mean", "{:.1f}"),
    ("  the same, all their tokens / all their time (tok/s)", "colocated_decode_rate_pooled", "{:.1f}"),
    ("total tokens per second", "tokens_per_s", "{:.1f}"),
    ("turn latency p99, all turns (s)", "turn_latency_p99_s", "{:.0f}"),
    ("turn latency p50 (s)", "turn_latency_p50_s", "{:.0f}"),
    ("uncharged contention, all requests (s per run)", "uncharged_contention_s", "{:,.0f}"),
    ("turns completed / failed", None, ""),
    ("turn latency p99 without the turns caught by the freeze (s)", "turn_latency_p99_unfrozen_s", "{:.0f}"),
    ("turns caught by the freeze", "turns_caught_by_freeze", "{:d}"),
    ("engine-seconds lost to the frozen engine (per run)", "lost_to_fault_engine_seconds", "{:,.0f}"),
    ("warm turns not caught by the freeze: time to first token p99 (s)", "warm_turn_ttft_p99_s", "{:.1f}"),
    ("storm spans: arrival to last first token (s per run)", "storm_span_s", "{:.0f}"),
    ("replay verdicts held (runs with all engine-time verdicts)", "verdicts_held", ""),
    (
        "  caught by the freeze, moved, still decoding elsewhere at the end",
        "caught_decoding_elsewhere_at_end",
        "{:d}",
    ),
    ("largest event-loop stall (real s)", "loop_stall_max_real_s", "{:.2f}"),
)


WITHOUT_CHANGE = ("loop_stall_max_real_s",)  # a run's fidelity, not a figure of admission


def prefill_config(config: ReplayConfig, seed: int, mode: str) -> ReplayConfig:
    """The replay configuration of one run: `config` at `seed`, admission off or on, token times recorded."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return replace(config, seed=seed, prefill_admission=mode == "on", record_token_times=True)


def _request_of_turn(records: dict[str, Any]) -> dict[str, str]:
    """Each turn's gateway request: the request id of its last client attempt (the one that answered)."""
    out: dict[str, str] = {}
    for attempt in sorted(records["attempts"], key=lambda a: a["arrived_at"]):
        if attempt["request_id"]:
            out[attempt["tag"]] = attempt["request_id"]
    return out


def _caught_by_freeze(records: dict[str, Any], run_end: float) -> set[str]:
    """Gateway requests with a generation on the frozen engine when it froze or sent there after."""
    freeze = next((e for e in records["events"] if e["kind"] == "freeze"), None)
    if freeze is None:
        return set()
    engine, at = int(freeze["engine"]), float(freeze["at"])
    return {
        split_rid(g["rid"])[0]
        for g in records["generations"]
        if g["engine"] == engine and (g["finished_at"] if g["finished_at"] is not None else run_end) > at
    }


def _frozen_engine(records: dict[str, Any]) -> int | None:
    freeze = next((e for e in records["events"] if e["kind"] == "freeze"), None)
    return None if freeze is None else int(freeze["engine"])


def measure(records: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run (one seed, one mode) from its replay records (`record_token_times` on)."""
    config = ReplayConfig.from_json(records["config"])
    run_end = float(records["ended_at"])
    if records["generations"] and "token_times" not in records["generations"][0]:
        raise ValueError("these records have no token times: run the replay with record_token_times")
    generations = generations_of(records["generations"], run_end)
    by_request = last_attempts(generations)
    request_of = _request_of_turn(records)
    storms = [
        (e["wave"], float(e["at"]), int(e["sessions"])) for e in records["events"] if e["kind"] == "storm"
    ]
    caught = _caught_by_freeze(records, run_end)
    caught_tags = frozenset(t["tag"] for t in records["turns"] if request_of.get(t["tag"]) in caught)
    turns = records["turns"]
    spans, latencies, warm_ttft = turn_times(
        turns, request_of, by_request, storms, run_end, left_out=caught_tags
    )
    unfrozen = sorted(
        t["ended_at"] - t["started_at"]
        for t in turns
        if t["ok"] and t["ended_at"] is not None and t["tag"] not in caught_tags
    )
    decode = decode_during_storms(spans, generations, held=held_spans(records["holds"], run_end))
    replay = measure_replay(records)
    held = verdicts(config, {"engine": replay})
    stall = replay["loop_stalls"]["max_real_s"]
    out = {
        "mode": "on" if config.prefill_admission else "off",
        "seed": config.seed,
        **shared_figures(
            spans=spans,
            decode=decode,
            latencies=latencies,
            warm_ttft=warm_ttft,
            tokens_per_s=sum(int(g["completion_tokens"]) for g in records["generations"]) / run_end,
            contention=[(e.get("timing") or {}).get("contention_s", 0.0) for e in records["ends"]],
            completed=len(latencies),
            failed=sum(1 for t in turns if t["ok"] is False),
        ),
        "turn_latency_p99_unfrozen_s": percentile(unfrozen, 99),
        "turns_caught_by_freeze": len(caught_tags),
        "caught_decoding_elsewhere_at_end": sum(
            1
            for r in caught
            if r in by_request
            and by_request[r].engine != _frozen_engine(records)
            and by_request[r].first_token_at is not None
            and by_request[r].ended_at >= run_end
        ),
        "lost_to_fault_engine_seconds": float(replay["lost_to_fault_engine_seconds"]),
        "verdicts": held,
        "verdicts_ok": int(all(v["ok"] for v in held)),
        "verdicts_held": f"{sum(v['ok'] for v in held)} of {len(held)} verdicts",
        "loop_stall_max_real_s": float(stall),
        "is_disturbed": int(stall * config.time_scale > 0.5 * config.stall_timeout_s),
        "real_s": float(records["real_s"]),
    }
    out["raw"]["latencies_unfrozen"] = unfrozen
    return out


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs pooled (see the module docstring)."""
    out = pool(runs, _PERCENTILES)
    out["verdicts_held"] = f"{sum(f['verdicts_ok'] for f in runs)} of {len(runs)}"
    out["loop_stall_max_real_s"] = max(f["loop_stall_max_real_s"] for f in runs)
    out["seeds"] = [f["seed"] for f in runs]
    out.pop("seed", None)
    return out


async def compare(
    config: ReplayConfig,
    seeds: list[int],
    out_dir: Path,
    *,
    together: bool = True,
    in_process: bool = False,
    log: Any = print,
) -> dict[str, list[dict[str, Any]]]:
    """Run every seed off and on (`together`: both at once, one process each; else one after the other) and
    measure them; the runs' figures by mode, in seed order. Each run's records stay in `out_dir`.
    `in_process`: run them in this process instead, on one event loop (for tests: LiteLLM is imported once)."""
    out_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before anything runs
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for seed in seeds:
        jobs = [
            WorkerJob(label=f"seed{seed}-{m}", config=prefill_config(config, seed, m), mode="engine")
            for m in MODES
        ]
        started = time.perf_counter()
        batches = [jobs] if together else [[job] for job in jobs]
        for batch in batches:
            log(
                f"seed {seed}: {', '.join(j.label for j in batch)} ({config.duration_s:.0f} simulated s "
                f"at x{config.time_scale:g}, ~{config.real_s(config.duration_s):.0f} s)"
            )
            records = await (run_in_process if in_process else run_workers)(batch, out_dir)
            for job in batch:
                figures = measure(records[job.label].to_json())
                per_mode[figures["mode"]].append(figures)
        log(f"seed {seed} done in {time.perf_counter() - started:.0f} s")
        log(table({m: per_mode[m][-1] for m in MODES}, ROWS, without_change=WITHOUT_CHANGE))
    return per_mode


def _strip(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in figures.items() if k != "raw"}


def _disturbed(per_mode: dict[str, list[dict[str, Any]]]) -> list[str]:
    return [f"seed {f['seed']} {f['mode']}" for runs in per_mode.values() for f in runs if f["is_disturbed"]]


def remeasure(out_dir: Path, seeds: list[int]) -> dict[str, list[dict[str, Any]]]:
    """The figures of runs recorded earlier in `out_dir` (records-seed<N>-<mode>.json), by mode."""
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for seed in seeds:
        for mode in MODES:
            path = out_dir / f"records-seed{seed}-{mode}.json"
            per_mode[mode].append(measure(orjson.loads(path.read_bytes())))
    return per_mode


def main(argv: list[str] | None = None) -> int:
    defaults = ReplayConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill.replay", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--seeds", default="0,1,2,3,4,5,6", help="workload seeds, comma-separated (pooled; default 7 seeds)"
    )
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="simulated seconds")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run off and on one after the other (default: together, one process each)",
    )
    parser.add_argument(
        "--remeasure",
        action="store_true",
        help="run nothing: measure again the runs recorded in --out for --seeds",
    )
    parser.add_argument("--out", type=Path, default=Path("out/prefill-replay"))
    args = parser.parse_args(argv)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    seeds = parse_seeds(args.seeds)
    if not seeds:
        parser.error("--seeds needs at least one seed")
    config = replace(defaults, time_scale=args.time_scale, agents=args.agents, duration_s=args.duration)
    summary_path = args.out / "prefill_replay.json"
    started = time.perf_counter()
    if args.remeasure:
        per_mode = remeasure(args.out, seeds)
        earlier = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        wall_s = float(earlier.get("wall_s") or 0.0)
        config = ReplayConfig.from_json(earlier["config"]) if "config" in earlier else config
        together = bool(earlier.get("together", True))
    else:
        log = lambda line: print(line, flush=True)  # noqa: E731
        per_mode = asyncio.run(compare(config, seeds, args.out, together=not args.one_at_a_time, log=log))
        wall_s = time.perf_counter() - started
        together = not args.one_at_a_time
    figures = {m: pool_runs(per_mode[m]) for m in MODES}
    text = table(figures, ROWS, without_change=WITHOUT_CHANGE)
    per_seed = per_seed_lines(per_mode)
    print(f"\n{len(seeds)} seed(s) pooled, {wall_s:.0f} s of real time\n\n{text}\n\n{per_seed}")
    disturbed = _disturbed(per_mode)
    if disturbed:
        print(
            f"\nWARNING: the event loop fell behind by more than half of stall_timeout in {', '.join(disturbed)}:"
            " the machine was busy; rerun before publishing (or lower --time-scale)",
            file=sys.stderr,
        )
    result = {
        "config": config.to_json(),
        "seeds": seeds,
        "together": together,
        "wall_s": round(wall_s, 1),
        "figures": {m: _strip(f) for m, f in figures.items()},
        "per_seed": {m: [_strip(f) for f in runs] for m, runs in per_mode.items()},
        "disturbed": disturbed,
    }
    summary_path.write_text(json.dumps(json_safe(result), indent=2))
    (args.out / "prefill_replay.md").write_text(text + "\n\n" + per_seed + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
