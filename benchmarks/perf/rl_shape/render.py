"""The RL shape's report: the load, the goals' verdicts and one row per path, in Markdown."""

from __future__ import annotations

from typing import Any

from benchmarks.perf.report import format_value as fmt
from benchmarks.perf.rl_shape.plan import TOKENS_PER_S
from benchmarks.perf.rl_shape.verdict import paired_added_pct

__all__ = ("render",)


def render(result: dict[str, Any]) -> str:
    options, plan = result["options"], result["plan"]
    meta = result["meta"]
    lines = [
        f"RL shape, {meta['started']} ({meta.get('elapsed_s', 0):.0f} s): `{meta['command']}` on {meta['code']}",
        "",
        f"Load: {plan['workers']} non-streaming clients (aiohttp, no timeout), {options['engines']} simulated SGLang "
        f"engines x {options['running_per_engine']} running ({options['engine_slots']} slots each), "
        f"decode {TOKENS_PER_S:g} tok/s per request, time scale {options['time_scale']:g} "
        f"(a 32K-token decode = {32768 / TOKENS_PER_S / options['time_scale']:.0f} s real); "
        f"{plan['turns']:,} turns in {plan['sessions']:,} sessions, input_ids {plan['input_len']['min']:,}-"
        f"{plan['input_len']['max']:,} (p50 {plan['input_len']['p50']:,.0f}), max_new_tokens "
        f"{plan['max_new']['min']:,}-{plan['max_new']['max']:,} (p50 {plan['max_new']['p50']:,.0f}, mean "
        f"{plan['max_new']['mean']:,.0f}, density ~1/x^2), {plan['generated_tokens']:,} tokens per phase; "
        f"target {options['concurrency'] * TOKENS_PER_S * options['time_scale']:,.0f} generated tok/s. "
        f"SGLang Model Gateway policy: {options['router_policy']}"
        + "".join(f"; {name} {version}" for name, version in meta.get("routers", {}).items())
        + ".",
        "",
        "| goal | measured | verdict |",
        "| --- | --- | --- |",
    ]
    for row in result["goals"]:
        lines.append(f"| {row['goal']} | {row['measured']} | {row['verdict']} |")
    lines += [
        "",
        "| path | turns ok | failed | cut | wall s | gen tok/s | bytes/req | chunks/req | bytes/tok | cache hit "
        "| CPU-s/M tok | idle RSS MB | max RSS MB | peak in flight | bodies MB | RSS/body | p50 s | p99 s "
        "| paired added p50 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |",
    ]
    direct = result["phases"].get("direct")
    for name, phase in result["phases"].items():
        peak = phase["peak"] or {}
        paired = None if direct is None or name == "direct" else paired_added_pct(phase, direct)
        hit = phase["cache_hit"]
        lines.append(
            f"| {name} | {phase['turns_ok']:,} / {phase['turns_planned']:,} | {phase['failed']:,} | "
            f"{phase['cut'] + phase['skipped']:,} | {phase['wall_s']:.1f} | {fmt(phase['generated_tokens_per_s'])} "
            f"| {fmt(phase['output_bytes_per_request'], 0)} | {fmt(phase['output_chunks_per_request'], 1)} "
            f"| {fmt(phase['output_bytes_per_token'], 1)} | {'-' if hit is None else f'{100 * hit:.1f}%'} "
            f"| {fmt(phase['gateway_cpu_s_per_million_tokens'])} | {fmt(phase['idle_rss_mb'], 0)} "
            f"| {fmt(phase['max_rss_mb'], 0)} | {fmt(peak.get('in_flight'))} "
            f"| {fmt(peak.get('in_flight_bytes', 0) / 1e6 if peak else None, 1)} "
            f"| {fmt(phase['rss_per_body_byte'])} | {fmt(phase['latency_p50_s'])} "
            f"| {fmt(phase['latency_p99_s'])} | {'-' if paired is None else f'{paired:+.2f}%'} |"
        )
    sources = {phase["output_work_source"] for phase in result["phases"].values()}
    lines += ["", "Engine output work from: " + "; ".join(sorted(sources)) + "."]
    lines += ["", "What limited the run:"] + [f"- {line}" for line in result["limits"]]
    errors = {name: phase["errors"] for name, phase in result["phases"].items() if phase["errors"]}
    for name, sample in errors.items():
        lines.append(f"- {name}: errors seen: {'; '.join(sample[:3])}")
    return "\n".join(lines)
