"""Drawing the view of `rolloutgate top` with rich: a header of totals and rates, then one row per engine.

Pure: a TopView in, a rich renderable out (the terminal, the refresh loop and the clock are cli.py's).
A figure that cannot be known yet (a rate before the second reading) or is not exported is shown "-".
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rolloutgate.top.view import SPLIT_CLOCKS, EngineRow, TopView

__all__ = ("render",)

NONE = "-"
_LEFT = frozenset({"engine", "state", "prefill", "url"})
STATE_STYLES = {
    "healthy": "green",
    "prefilling": "cyan",
    "paused by gate": "yellow",
    "paused by trainer": "yellow",
    "joining": "dim",
    "hung": "bold red",
    "unhealthy": "red",
    "quarantined": "bold white on red",
}


def render(view: TopView, *, title: str) -> RenderableType:
    """The whole screen: `title` (what is watched, how often), totals, failures, clocks, then the engines."""
    parts: list[RenderableType] = [Text(title, style="bold")]
    parts.extend(_gateway_lines(view))
    parts.append(_failure_line(view))
    parts.append(_split_line(view))
    parts.append(_engine_table(view))
    return Group(*parts)


def _gateway_lines(view: TopView) -> list[Text]:
    lines = []
    for gateway in view.gateways:
        line = Text(f"gateway {gateway.key}" if gateway.key != gateway.url else f"gateway {gateway.url}")
        if gateway.error is not None:
            line.append("  unreachable: ", style="bold red")
            line.append(gateway.error)
        else:
            line.append("  gate ")
            line.append(gateway.gate, style="green" if gateway.gate == "open" else "bold yellow")
            line.append(f"  queued {gateway.queue_depth}  in flight {gateway.in_flight}")
        lines.append(line)
    total = Text(f"queued {view.queue_depth}  in flight {view.in_flight}/{_count(view.capacity)}")
    total.append(f"  {_rate(view.tokens_per_s)} tok/s")
    lines.append(total)
    return lines


def _failure_line(view: TopView) -> Text:
    line = Text("per minute: ")
    line.append(f"timeouts {_rate(view.timeouts_per_min, 1)}  stalls {_rate(view.stalls_per_min, 1)}  ")
    line.append(f"quarantines {_rate(view.quarantines_per_min, 1)}")
    others = {
        reason: rate
        for reason, rate in (view.failures_per_min or {}).items()
        if rate > 0 and reason not in ("timeout", "queue_timeout", "max_wall", "stall")
    }
    if others:
        line.append("  other failures " + ", ".join(f"{r} {v:.1f}" for r, v in sorted(others.items())))
    line.append("   wasted engine-s ")
    if view.wasted_engine_s is None:
        line.append(NONE)
    else:
        line.append(f"{view.wasted_engine_s:,.0f}", style="bold red" if view.wasted_engine_s > 0 else "")
        line.append(f" ({_rate(view.wasted_per_s, 1)}/s)")
        reasons = sorted(((v, r) for r, v in view.wasted_by_reason.items() if v > 0), reverse=True)
        if reasons:
            line.append(" " + ", ".join(f"{r} {v:,.0f}" for v, r in reasons[:3]))
    return line


def _split_line(view: TopView) -> Text:
    split = view.split
    span = (
        "since start"
        if split.span_s is None
        else f"in the last {split.span_s:.{1 if split.span_s < 10 else 0}f} s"
    )
    line = Text(f"clocks of {split.requests:,.0f} requests finished {span}: ")
    if split.requests <= 0 or split.wall_s <= 0:
        line.append(NONE)
        return line
    shares = []
    for clock in SPLIT_CLOCKS:
        share = split.share(clock)
        shares.append(f"{clock} {NONE if share is None else f'{share:.0%}'}")
    line.append("  ".join(shares))
    line.append(f"  (mean wall {split.wall_s / split.requests:,.1f} s)")
    return line


def _engine_table(view: TopView) -> Table:
    has_replicas = any(row.replica is not None for row in view.engines)
    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    if has_replicas:
        table.add_column("replica")
    for name in ("engine", "state", "running", "queued", "tok/s", "prefill", "silent", "cache hit", "url"):
        table.add_column(name, justify="left" if name in _LEFT else "right")
    for row in view.engines:
        cells: list[RenderableType] = [row.engine_id, Text(row.state, style=STATE_STYLES.get(row.state, ""))]
        cells.extend(_load_cells(row))
        table.add_row(*([row.replica or NONE] if has_replicas else []), *cells)
    return table


def _load_cells(row: EngineRow) -> list[str]:
    running = NONE if row.running is None else str(row.running)
    if row.capacity is not None and row.running is not None:
        running = f"{row.running}/{_count(row.capacity)}"
    silent = NONE
    if row.silent_s is not None:
        silent = f"{row.silent_s:.0f}s" + (
            f"/{row.hung_after_s:.0f}s" if row.hung_after_s is not None else ""
        )
    return [
        running,
        NONE if row.queued is None else str(row.queued),
        _rate(row.tokens_per_s),
        "long" if row.is_prefilling else NONE,
        silent,
        NONE if row.cache_hit_rate is None else f"{row.cache_hit_rate:.0%}",
        row.url,
    ]


def _rate(value: float | None, digits: int = 0) -> str:
    return NONE if value is None else f"{value:,.{digits}f}"


def _count(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:g}"
