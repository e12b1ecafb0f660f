"""The RL shape's verdicts: each goal's measured value and verdict, pure arithmetic over the phases' summaries
(`goals`), the paired added latency, and what limited the run (`limits`)."""

from __future__ import annotations

import itertools
import math
from typing import Any

from benchmarks.kit.stats import percentile
from benchmarks.perf.rl_shape.phase import added_pct, ratio
from benchmarks.perf.rl_shape.plan import GATEWAYS, MINE, ROUTER_PATHS

__all__ = (
    "GOAL_ADDED_LATENCY_PCT",
    "GOAL_CPU_VS_ROUTER",
    "GOAL_LOOP_LAG_P99_S",
    "GOAL_OUTPUT_WORK",
    "GOAL_RSS_PER_BODY",
    "OUTPUT_ALLOWANCE",
    "goals",
    "limits",
    "paired_added_pct",
    "verdict",
)

# goals (issue 19 item 6)
GOAL_OUTPUT_WORK = 1.1  # engine output bytes (and chunks) per request through a gateway, over direct ...
# ... plus a small constant per request: a first-token chunk (rolloutgate's progress signal on /generate)
OUTPUT_ALLOWANCE = {"bytes": 4096.0, "chunks": 1.0}
GOAL_CPU_VS_ROUTER = 1.0  # rolloutgate CPU-s per M generated tokens over the SGLang Model Gateway's
GOAL_RSS_PER_BODY = 1.5  # (RSS at peak in flight - idle RSS) / request-body bytes in flight
GOAL_ADDED_LATENCY_PCT = 1.0  # added p50 and p99 turn latency over direct, % of the turn
GOAL_LOOP_LAG_P99_S = 0.01  # rolloutgate's own event-loop lag at p99 (server/loop_lag.py), seconds


def verdict(value: float | None, goal: float) -> str:
    """`met` when `value` <= `goal` (every goal here is an upper bound)."""
    if value is None or math.isnan(value):
        return "not measured"
    return "met" if value <= goal else "NOT met"


# ----------------------------------------------------------------------------------------------- one phase


def goals(phases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal's measured value and verdict, from the phases' summaries (`PhaseResult.summary()`)."""
    rows: list[dict[str, Any]] = []
    direct = phases.get("direct")
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None or direct is None:
            continue
        for what, key, token_key in (
            ("bytes", "output_bytes_per_request", "output_bytes_per_token"),
            ("chunks", "output_chunks_per_request", None),
        ):
            value = ratio(phase.get(key), direct.get(key))
            allowance = OUTPUT_ALLOWANCE[what]
            mine, theirs = phase.get(key), direct.get(key)
            # the goal: at most 1.1x the direct call's plus the allowance, per request
            within = (
                None if mine is None or theirs is None else mine / (GOAL_OUTPUT_WORK * theirs + allowance)
            )
            note = (
                f" ({mine:,.1f} vs {theirs:,.1f} per request)"
                if mine is not None and theirs is not None
                else ""
            )
            if (phase.get("phase_cut_at_cap") or direct.get("phase_cut_at_cap")) and token_key is not None:
                # a cut phase's counters hold partial generations: per generated token is the fair measure
                value = within = ratio(phase.get(token_key), direct.get(token_key))
                within = None if within is None else within / GOAL_OUTPUT_WORK
                note = " (a phase was cut: per generated token)"
            rows.append(
                {
                    "goal": f"engine output {what} per request via {name} <= {GOAL_OUTPUT_WORK:g}x direct "
                    f"+ {allowance:g}",
                    "value": value,
                    "measured": "-" if value is None else f"x{value:,.2f}{note}",
                    "verdict": verdict(within, 1.0),
                }
            )
    for mine_name, router_name in itertools.product(MINE, ROUTER_PATHS):
        mine, router = phases.get(mine_name), phases.get(router_name)
        if mine is None or router is None:
            continue
        a = mine.get("gateway_cpu_s_per_million_tokens")
        b = router.get("gateway_cpu_s_per_million_tokens")
        value = ratio(a, b)
        rows.append(
            {
                "goal": f"{mine_name} CPU-s per M generated tokens over {router_name}'s <= {GOAL_CPU_VS_ROUTER:g}",
                "value": value,
                "measured": "-"
                if value is None
                else f"x{value:,.2f} ({a:,.2f} vs {b:,.2f} CPU-s per M tokens)",
                "verdict": verdict(value, GOAL_CPU_VS_ROUTER),
            }
        )
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None:
            continue
        value = phase.get("rss_per_body_byte")
        peak = phase.get("peak") or {}
        rows.append(
            {
                "goal": f"{name} (RSS at peak in flight - idle) / in-flight request bodies <= {GOAL_RSS_PER_BODY:g}",
                "value": value,
                "measured": "-"
                if value is None
                else f"{value:,.2f} ({peak.get('in_flight', 0)} in flight, {peak.get('in_flight_bytes', 0) / 1e6:,.1f} MB of bodies)",
                "verdict": verdict(value, GOAL_RSS_PER_BODY),
            }
        )
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None or direct is None:
            continue
        cut = bool(phase.get("phase_cut_at_cap") or direct.get("phase_cut_at_cap"))
        for q in (50, 99):
            # p50: paired, each turn against the same turn sent directly (the same prompt, length and session),
            # so the other processes' share of this machine's CPU moves both sides of each pair alike. p99: the
            # phases' own p99 against each other; the p99 of the paired per-turn figures is the tail of the
            # turn-to-turn noise instead (the direct phase run again shows it: its noise-floor rows)
            paired = paired_added_pct(phase, direct, q)
            unpaired = added_pct(phase.get(f"latency_p{q}_s"), direct.get(f"latency_p{q}_s"))
            value = paired if q == 50 else unpaired
            if q == 50:
                detail = f"the phases' p50: {phase['latency_p50_s']:.2f} s vs {direct['latency_p50_s']:.2f} s, {unpaired:+.2f}%"
            else:
                detail = f"{phase['latency_p99_s']:.2f} s vs {direct['latency_p99_s']:.2f} s; paired per turn {paired:+.2f}%"
            rows.append(
                {
                    "goal": f"added turn latency via {name} over direct, p{q} of the turns"
                    + (" (paired)" if q == 50 else " (the phases' p99)")
                    + f", <= {GOAL_ADDED_LATENCY_PCT:g}% of the turn",
                    "value": value,
                    "measured": "-"
                    if value is None or paired is None or unpaired is None
                    else f"{value:+.2f}% ({detail})"
                    + (" (a phase was cut: over the turns each answered)" if cut else ""),
                    "verdict": verdict(value, GOAL_ADDED_LATENCY_PCT),
                }
            )
    for mine_name in MINE:
        lag = (phases.get(mine_name) or {}).get("loop_lag_s")
        if not lag:
            continue
        p99 = lag.get("p99")
        rows.append(
            {
                "goal": f"{mine_name}'s event-loop lag p99 <= {1000 * GOAL_LOOP_LAG_P99_S:g} ms (its /metrics)",
                "value": p99,
                "measured": "-"
                if p99 is None
                else f"<= {1000 * p99:g} ms (p50 <= {1000 * (lag.get('p50') or 0):g} ms; bucket bounds)",
                # a bucket's bound: p99 under the goal when its bucket ends at or below it
                "verdict": verdict(p99, GOAL_LOOP_LAG_P99_S),
            }
        )
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None or not phase.get("turns_planned"):
            continue
        failed = phase.get("failed", 0)
        rows.append(
            {
                "goal": f"no turn via {name} fails (timeouts included)",
                "value": failed,
                "measured": f"{failed:,} failed of {phase['turns_planned']:,}",
                "verdict": verdict(failed, 0),
            }
        )
    again = phases.get("direct-again")
    for q in (50, 99):
        value = None if again is None or direct is None else paired_added_pct(again, direct, q)
        if value is not None:
            rows.append(
                {
                    "goal": f"the noise floor: direct again over direct, p{q} of the turns (no goal)",
                    "value": value,
                    "measured": f"{value:+.2f}%",
                    "verdict": "reference",
                }
            )
    return rows


def paired_added_pct(phase: dict[str, Any], direct: dict[str, Any], q: float = 50) -> float | None:
    """The q-th percentile over the turns answered in both phases of each turn's added latency, % of its
    latency sent directly."""
    mine = {(w, i): lat for w, i, status, lat in phase["turns"] if status == 200 and lat}
    theirs = {(w, i): lat for w, i, status, lat in direct["turns"] if status == 200 and lat}
    values = [100.0 * (mine[k] / theirs[k] - 1.0) for k in mine.keys() & theirs.keys()]
    return percentile(values, q, method="linear") if values else None


def limits(result: dict[str, Any]) -> list[str]:
    """What bounded this run: the simulator's and the client's CPU, the decode lag, cut phases."""
    options = result["options"]
    client_cpu = result["meta"].get("client_cpu")
    beside = f"CPU {client_cpu}, shared with the clients" if client_cpu else "unpinned, beside the clients"
    lines = []
    for name, phase in result["phases"].items():
        sim, client, stretch = phase["sim_cores"], phase["client_cores"], phase["stretch_p50"]
        flags = []
        if sim is not None and sim >= 0.85:
            flags.append("the simulator's CPU is saturated: it is the bottleneck")
        if stretch is not None and not math.isnan(stretch) and stretch > 1.05:
            flags.append(f"turns took x{stretch:.2f} their simulated decode (median)")
        if phase["phase_cut_at_cap"]:
            flags.append(f"cut at the {options['phase_cap_s']:g} s cap")
        neighbours = phase.get("neighbours_cores") or {}
        if (neighbours.get("client_cpu") or 0) >= 0.15 or (neighbours.get("server_cpu") or 0) >= 0.15:
            flags.append(
                f"other processes on the shared VM took {neighbours.get('client_cpu') or 0:.2f} cores of the "
                f"simulator's CPU and {neighbours.get('server_cpu') or 0:.2f} of the gateway's"
            )
        busy = phase["engine_counters"].get("output_busy_s")
        simulated_s = phase["wall_s"] * options["time_scale"] * options["engines"]
        if busy is not None and simulated_s > 0:
            share = busy / simulated_s
            note = f"the engines' output path (tokenizer manager) busy {100 * share:.1f}% of the time"
            if share >= 0.01:
                flags.append(note + ("; it is the bottleneck" if share >= 0.85 else ""))
        gateway = "" if phase["gateway_cores"] is None else f", gateway {phase['gateway_cores']:.2f} cores"
        lines.append(
            f"{name}: simulator {sim:.2f} cores ({beside}: {client:.2f} cores){gateway}; "
            f"median turn x{stretch:.3f} its simulated decode" + (f"; {'; '.join(flags)}" if flags else "")
        )
    return lines
