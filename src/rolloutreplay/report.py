"""The replay's terminal report: one table, engine time next to wallclock, then the verdicts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from rolloutreplay.result import ReplayResult

__all__ = ("fidelity_warnings", "figures_table", "markdown_report", "print_report", "verdicts_table")

Row = tuple[str, Callable[[dict[str, Any]], str]]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} s"


def _detection(f: dict[str, Any]) -> str:
    d = f["detection"]
    if d.get("frozen_engine") is None:
        return "-"
    if d.get("detected_after_s") is None:
        return "never"
    allowance = d.get("prefill_allowance_s") or 0.0
    extra = f", {allowance:.0f} s for prompts sent after the freeze" if allowance else ""
    return f"{d['detected_after_s']:.1f} s ({d['detected_as']}{extra})"


def _frozen(f: dict[str, Any]) -> str:
    r = f["frozen_engine_requests"]
    if not r:
        return "-"
    moving = r.get("still_running_elsewhere_at_end", 0)
    running = f", {moving} still running elsewhere at the end" if moving else ""
    return f"{r['answered_by_other_engines']}/{r['caught']} answered elsewhere{running}, {r['failed']} failed"


def _chains(f: dict[str, Any]) -> str:
    attempts = f["failed_turn_attempts"]
    if not attempts:
        return "-"
    counts = ", ".join(f"{n} x {k} attempts" for k, n in sorted(attempts.items(), key=lambda kv: int(kv[0])))
    return f"{counts}; median {_seconds(f['failed_turn_chain_s_median'])}"


def _bursts(f: dict[str, Any]) -> str:
    """Of the turns in flight at each event that fit in the client timeout when undisturbed, how many died."""
    return ", ".join(f"{e['fitting_killed']}/{e['fitting_in_flight']}" for e in f["events"]) or "-"


def _waste(f: dict[str, Any], other: dict[str, Any] | None) -> str:
    text = f"{f['wasted_engine_seconds']:,.0f}"
    if other is not None and other["wasted_engine_seconds"] > 0 and f is not other:
        text += f" ({100 * f['wasted_engine_seconds'] / other['wasted_engine_seconds']:.1f}% of wallclock)"
    return text


def _budget(f: dict[str, Any]) -> str:
    """The gateway's count of tokens its budgets saved; the turns they capped and those refused at a full
    budget, when any."""
    b = f["budgets"]
    text = f"{b['tokens_saved']:,}"
    if b["turns_capped"] or b["turns_at_full_budget"]:
        text += f" ({b['turns_capped']} turns capped, {b['turns_at_full_budget']} refused at a full budget)"
    return text


def _forbidden_tokens(f: dict[str, Any]) -> str:
    """Tokens generated under a version older than the fleet's newest: in delivered answers / in all."""
    w = f.get("weights")
    if not w:
        return "-"
    return f"{w['forbidden_tokens_served']:,} / {w['forbidden_tokens_generated']:,}"


def _half_updated(f: dict[str, Any]) -> str:
    w = f.get("weights")
    if not w:
        return "-"
    reasons = w["half_updated_by_reason"]
    names = (("mid_update", "mid-update"), ("update_pending", "update pending"), ("behind", "behind"))
    detail = ", ".join(f"{reasons[k]} {label}" for k, label in names if reasons.get(k))
    return f"{w['half_updated_dispatches']:,}" + (f" ({detail})" if detail else "")


ROWS: list[Row] = [
    ("client-visible failures (turns)", lambda f: f"{f['client_visible_failures']}"),
    ("  of which progressing when killed", lambda f: f"{f['client_visible_failures_progressing']}"),
    ("spurious timeouts (killed while progressing)", lambda f: f"{f['spurious_timeouts']}"),
    ("client attempts killed", lambda f: f"{f['killed_attempts']} of {f['attempts']}"),
    ("generations started / answers delivered", lambda f: f"{f['generations']} / {f['answers_delivered']}"),
    (
        "engine-seconds lost to the frozen (or a restarted) engine",
        lambda f: f"{f['lost_to_fault_engine_seconds']:,.0f}",
    ),
    ("completed turns", lambda f: f"{f['turns']['completed']}"),
    (
        "turn latency p50 / p99",
        lambda f: f"{_seconds(f['turns']['latency_p50_s'])} / {_seconds(f['turns']['latency_p99_s'])}",
    ),
    ("in flight at storm, update, storm: killed", _bursts),
    ("freeze -> frozen engine detected", _detection),
    ("requests caught by the frozen engine", _frozen),
    ("failed turns: LiteLLM attempts, time", _chains),
    ("prefill tokens saved (groups)", lambda f: f"{f['group_prefill_tokens_saved']:,}"),
    ("tokens saved by budgets", _budget),
    ("aborted as stale (requeued)", lambda f: f"{f['stale_requests']['requeued']:,}"),
    ("partial samples (stale, answered so far)", lambda f: f"{f['stale_requests']['partial']:,}"),
    ("tokens on weights older than the fleet's newest: served / generated", _forbidden_tokens),
    ("dispatches to a half-updated engine", _half_updated),
]


HEADERS = {"engine": "engine time", "wallclock": "wallclock"}


def _rows(result: ReplayResult) -> tuple[list[str], list[list[str]]]:
    """The column headers and rows of the figures table (shared by the terminal and the markdown)."""
    modes = [m for m in ("engine", "wallclock") if m in result.figures]
    wall = result.figures.get("wallclock")
    rows = [[label, *(cell(result.figures[m]) for m in modes)] for label, cell in ROWS[:5]]
    rows.append(["wasted engine-seconds", *(_waste(result.figures[m], wall) for m in modes)])
    rows += [[label, *(cell(result.figures[m]) for m in modes)] for label, cell in ROWS[5:]]
    return [HEADERS[m] for m in modes], rows


def figures_table(result: ReplayResult) -> Table:
    headers, rows = _rows(result)
    table = Table(title="rolloutgate replay incident (simulated seconds)", title_justify="left")
    table.add_column("")
    for header in headers:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_report(result: ReplayResult) -> str:
    """The figures and the verdicts as markdown tables (DIR/replay.md, for docs and READMEs)."""
    headers, rows = _rows(result)
    lines = ["| | " + " | ".join(headers) + " |", "| --- |" + " ---: |" * len(headers)]
    lines += ["| " + " | ".join(cell.strip() for cell in row) + " |" for row in rows]
    lines += ["", "| mode | claim | measured | holds |", "| --- | --- | ---: | :---: |"]
    lines += [
        f"| {v['mode']} | {v['claim']} | {v['measured']} | {'yes' if v['ok'] else '**no**'} |"
        for v in result.verdicts
    ]
    return "\n".join(lines) + "\n"


def verdicts_table(result: ReplayResult) -> Table:
    table = Table(title="what the replay must show", title_justify="left")
    table.add_column("mode")
    table.add_column("claim")
    table.add_column("measured", justify="right")
    table.add_column("", justify="center")
    for v in result.verdicts:
        mark = "[green]yes[/green]" if v["ok"] else "[red]NO[/red]"
        table.add_row(v["mode"], v["claim"], str(v["measured"]), mark)
    return table


def fidelity_warnings(result: ReplayResult) -> list[str]:
    """Modes whose event loop fell far enough behind to distort timeouts, health checks and hung verdicts."""
    config = result.config
    out = []
    for mode, figures in result.figures.items():
        stalls = figures["loop_stalls"]
        if stalls["max_simulated_s"] > 0.5 * config.stall_timeout_s:
            out.append(
                f"{mode}: the event loop fell up to {stalls['max_real_s']:.1f} s behind "
                f"(= {stalls['max_simulated_s']:.0f} simulated s at x{config.time_scale:g}); this machine was "
                f"too busy for this time scale and the figures may be distorted: rerun with a lower --time-scale"
            )
    return out


def print_report(result: ReplayResult, console: Console | None = None) -> None:
    console = console or Console()
    console.print(figures_table(result))
    console.print(verdicts_table(result))
    for warning in fidelity_warnings(result):
        console.print(f"[yellow]warning[/yellow] {warning}")
