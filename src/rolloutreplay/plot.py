"""The replay's figure: per-engine timelines of both modes, timeouts over time, and the waste per mode.

Each generation is a bar on its engine's lane, from the moment the engine received it to its end, colored by
what became of it (answer delivered, wasted, lost to the frozen engine, still running at the end). In the
engine-time panel the stretches the gateway does not charge (another request's large prefill on the same engine,
a pause, a freeze) are drawn pale; in the wallclock panel every second counts against the timeout, so the bars
are solid. A black x marks each client attempt killed by a timeout. Dashed lines: storm waves; the shaded band:
the weight update; the red line: the freeze, and the triangle: when the gateway detected it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from rolloutreplay.measure import LARGE_PREFILL_TOKENS, GenerationView, view_generations
from rolloutreplay.result import ReplayResult

__all__ = ("draw",)

COLORS = {"delivered": "#2e7d32", "wasted": "#d32f2f", "fault": "#757575", "in_progress": "#64b5f6"}
LABELS = {
    "delivered": "answer delivered",
    "wasted": "wasted (no client got the answer)",
    "fault": "lost to the frozen engine",
    "in_progress": "running at the end",
}
TITLES = {"engine": "engine time (rolloutgate)", "wallclock": "wallclock (the incident's proxy)"}


def _uncharged(
    view: GenerationView, large: list[tuple[float, float, str]], holds: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Stretches of `view`'s life its gateway did not charge in engine-time mode."""
    start, end = view.record["submitted_at"], view.end_at
    spans = [(s, e) for s, e, rid in large if rid != view.record["rid"]] + holds
    clipped = sorted((max(s, start), min(e, end)) for s, e in spans if min(e, end) > max(s, start))
    merged: list[tuple[float, float]] = []
    for s, e in clipped:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _rows(views: list[GenerationView]) -> dict[str, int]:
    """Greedy lane rows so that bars on one engine do not overlap."""
    ends: list[float] = []
    rows = {}
    for view in sorted(views, key=lambda v: v.record["submitted_at"]):
        start = view.record["submitted_at"]
        row = next((i for i, end in enumerate(ends) if end <= start), None)
        if row is None:
            row = len(ends)
            ends.append(view.end_at)
        else:
            ends[row] = view.end_at
        rows[view.record["rid"]] = row
    return rows


def _serving_at_kill(views: list[GenerationView]) -> dict[str, GenerationView]:
    """Per killed request, the generation that was serving it when it was killed (its latest dispatch)."""
    serving: dict[str, GenerationView] = {}
    for view in views:
        if view.killed_at is None or view.record["submitted_at"] > view.killed_at:
            continue
        best = serving.get(view.request_id)
        if best is None or view.record["submitted_at"] > best.record["submitted_at"]:
            serving[view.request_id] = view
    return serving


def _timeline(ax: Axes, records: dict[str, Any], figures: dict[str, Any]) -> None:
    views, _ = view_generations(records)
    mode = records["mode"]
    engines = len(records["engine_urls"])
    end = records["ended_at"]
    holds_by_engine: dict[int, list[tuple[float, float]]] = {}
    for hold in records["holds"]:
        stop = hold["end_at"] if hold["end_at"] is not None else end
        holds_by_engine.setdefault(hold["engine"], []).append((hold["start_at"], stop))
    base = 0.0
    ticks, tick_labels = [], []
    kills_by_tag: dict[str, list[dict[str, Any]]] = {}
    for kill in figures["kills"]:
        kills_by_tag.setdefault(kill["tag"], []).append(kill)
    for engine in range(engines):
        mine = [v for v in views if v.record["engine"] == engine]
        large = [
            (v.record["started_at"], v.record["first_token_at"] or v.end_at, v.record["rid"])
            for v in mine
            if v.record["started_at"] is not None
            and v.record["prompt_tokens"] - v.record["cached_tokens"] >= LARGE_PREFILL_TOKENS
        ]
        rows = _rows(mine)
        serving = _serving_at_kill(views)
        height = max(rows.values(), default=0) + 1
        for view in mine:
            y = base + rows[view.record["rid"]]
            start = view.record["submitted_at"]
            color = COLORS[view.outcome]
            ax.broken_barh([(start, view.end_at - start)], (y + 0.1, 0.8), facecolors=color, linewidth=0)
            if mode == "engine":
                pale = _uncharged(view, large, holds_by_engine.get(engine, []))
                if pale:
                    ax.broken_barh(
                        [(s, e - s) for s, e in pale],
                        (y + 0.1, 0.8),
                        facecolors="white",
                        alpha=0.6,
                        linewidth=0,
                    )
            if view.killed_at is not None and serving.get(view.request_id) is view:
                ax.plot([view.killed_at], [y + 0.5], marker="x", color="black", markersize=4, linewidth=0)
        ticks.append(base + height / 2)
        tick_labels.append(f"engine {engine}")
        ax.axhline(base + height + 0.25, color="#bbbbbb", linewidth=0.6)
        base += height + 0.5
    _events(ax, records, figures, base)
    ax.set_yticks(ticks, tick_labels)
    ax.set_ylim(-0.25, base)
    ax.set_xlim(0, end)
    ax.set_title(f"{TITLES.get(mode, mode)}: generations per engine", loc="left", fontsize=11)


def _events(ax: Axes, records: dict[str, Any], figures: dict[str, Any], top: float) -> None:
    for event in records["events"]:
        if event["kind"] == "storm":
            ax.axvline(event["at"], color="#ef6c00", linestyle="--", linewidth=1.2)
            ax.text(event["at"], top, " storm", color="#ef6c00", fontsize=8, va="bottom")
        elif event["kind"] == "update":
            ax.axvspan(
                event["at"], event.get("ended_at", event["at"]), color="#7e57c2", alpha=0.18, linewidth=0
            )
            ax.text(event["at"], top, " weight update", color="#5e35b1", fontsize=8, va="bottom")
        elif event["kind"] == "freeze":
            ax.axvline(event["at"], color="#b71c1c", linewidth=1.4)
            ax.text(
                event["at"],
                top,
                f" engine {event['engine']} freezes",
                color="#b71c1c",
                fontsize=8,
                va="bottom",
            )
            after = figures["detection"].get("detected_after_s")
            if after is not None:
                ax.plot([event["at"] + after], [top - 0.2], marker="v", color="#b71c1c", markersize=8)
        elif event["kind"] == "restart":
            ax.axvline(event["at"], color="#00838f", linestyle=":", linewidth=1.4)
            label = f" engine {event['engine']} restarts (launch weights)"
            ax.text(event["at"], top, label, color="#00838f", fontsize=8, va="bottom")


def _timeouts(ax: Axes, result: ReplayResult, bin_s: float) -> None:
    end = max(r.ended_at for r in result.records.values())
    bins = [i * bin_s for i in range(int(end // bin_s) + 2)]
    for mode, color in (("wallclock", "#d32f2f"), ("engine", "#2e7d32")):
        figures = result.figures.get(mode)
        if figures is None:
            continue
        times = [k["at"] for k in figures["kills"] if k["is_timeout"]]
        ax.hist(times, bins=bins, color=color, alpha=0.75, label=f"{TITLES[mode]}: {len(times)}")
    records = next(iter(result.records.values())).to_json()
    for event in records["events"]:
        style = {
            "storm": ("#ef6c00", "--"),
            "update": ("#5e35b1", "-"),
            "freeze": ("#b71c1c", "-"),
            "restart": ("#00838f", ":"),
        }.get(event["kind"], ("#616161", ":"))
        ax.axvline(event["at"], color=style[0], linestyle=style[1], linewidth=1.0)
    ax.set_xlim(0, end)
    ax.set_title(f"client attempts killed by a timeout, per {bin_s:.0f} s", loc="left", fontsize=11)
    ax.set_xlabel("simulated seconds")
    ax.legend(fontsize=8, loc="upper left")


def _waste(ax: Axes, result: ReplayResult) -> None:
    modes = [m for m in ("engine", "wallclock") if m in result.figures]
    wasted = [result.figures[m]["wasted_engine_seconds"] for m in modes]
    fault = [result.figures[m]["lost_to_fault_engine_seconds"] for m in modes]
    x = range(len(modes))
    ax.bar(x, wasted, color=COLORS["wasted"], label="wasted")
    ax.bar(x, fault, bottom=wasted, color=COLORS["fault"], label="lost to the frozen engine")
    for i, (w, f) in enumerate(zip(wasted, fault, strict=True)):
        ax.text(
            i, w + f, f"{w:,.0f} wasted\n{f:,.0f} lost to the fault", ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(list(x), [TITLES[m].split(" (")[0] for m in modes])
    ax.set_ylabel("engine-seconds")
    ax.set_title("wasted engine-seconds per mode", loc="left", fontsize=11)
    ax.margins(x=0.25, y=0.35)


def draw(result: ReplayResult, path: Path) -> None:
    """Write the figure of `result` to `path` (PNG)."""
    modes = [m for m in ("engine", "wallclock") if m in result.records]
    heights = [3.2] * len(modes) + [1.6]
    total = sum(heights) + 1.6
    fig = plt.figure(figsize=(15, total), dpi=110)
    grid = fig.add_gridspec(
        len(heights), 4, height_ratios=heights, hspace=0.45, wspace=0.35, top=1 - 1.3 / total, bottom=0.05
    )
    for row, mode in enumerate(modes):
        ax = fig.add_subplot(grid[row, :])
        _timeline(ax, result.records[mode].to_json(), result.figures[mode])
    _timeouts(fig.add_subplot(grid[len(modes), :3]), result, bin_s=60.0)
    _waste(fig.add_subplot(grid[len(modes), 3]), result)
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS]
    handles.append(
        Patch(facecolor=COLORS["delivered"], alpha=0.4, label="not charged (engine time: contention, pause)")
    )
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.55 / total),
        ncol=len(handles),
        fontsize=9,
        frameon=False,
    )
    config = result.config
    fig.suptitle(
        f"rolloutgate replay incident: {config.agents} agents, {config.engines} engines, "
        f"{config.duration_s:.0f} simulated s at x{config.time_scale:g}, LiteLLM timeout {config.client_timeout_s:.0f} s",
        y=1 - 0.15 / total,
        fontsize=12,
    )
    fig.savefig(path)
    plt.close(fig)
