"""Draw the Grafana dashboard (deploy/grafana/rolloutgate.json) on a replay's data, without Grafana.

    python scripts/render_dashboard.py --out out/dashboard --png docs/img/dashboard.png    (make dashboard-png)

1. Debian's Prometheus (`prometheus`, the package that gives promtool) runs on 127.0.0.1 and scrapes the
   gateway of an incident replay (`rolloutgate replay incident`'s engine-time mode, the production
   GatewayServer over simulated SGLang engines: storms of 100K-token prefills, a weight update through the
   gate, an engine that freezes for good) every 15 simulated seconds.
2. The replay runs `--time-scale` times faster than life, so a `[5m]` window of real time would be 5 x 24
   simulated minutes. Every sample Prometheus scraped is read back and re-stamped on the simulated clock
   (promtool tsdb create-blocks-from openmetrics), and a second Prometheus serves those blocks: the
   dashboard's queries then run unchanged, each window and rate in simulated time, as on a real deployment.
3. Each panel's PromQL is evaluated over the run with the HTTP query_range API (Grafana's variables set as
   Grafana would: every gateway, `$__rate_interval` = 4 scrape intervals) and drawn with matplotlib in the
   dashboard's own grid (24 columns; titles, units, legends). Dashed lines mark the replay's events.

The picture is the dashboard's queries on real data, drawn by this script; it is not a Grafana screenshot.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import FuncFormatter

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "rolloutgate.json"
SCRAPE_S = 15.0  # simulated seconds between scrapes, Prometheus' usual interval
RATE_INTERVAL = "1m"  # Grafana's $__rate_interval at a 15 s scrape: 4 intervals
EVENT_STYLE = {
    "storm": ("#6d4c41", "storm"),
    "update": ("#1565c0", "weight update"),
    "freeze": ("#c62828", "freeze"),
}
STATE_COLORS = {
    "healthy": "#43a047",
    "unhealthy": "#fb8c00",
    "quarantined": "#e53935",
    "open": "#43a047",
    "in_place": "#1565c0",
    "drain": "#fdd835",
    "abort": "#8e24aa",
    "retract": "#00897b",
    "external": "#6d4c41",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}?{query}" if query else url, timeout=60) as response:
        answer = json.loads(response.read())
    if answer.get("status") != "success":
        raise RuntimeError(f"{url}: {answer}")
    return answer["data"]


@contextmanager
def prometheus(binary: str, folder: Path, scrape: dict[str, Any] | None, *extra: str) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 with its data in `folder`/data; `scrape`: one job's scrape config, or None
    (serve the data there); `extra`: more flags. Yields its base URL; stopped (SIGTERM, waited for) on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"global": {"evaluation_interval": "1m"}, "scrape_configs": []}
    if scrape is not None:
        config["scrape_configs"].append(scrape)
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    command = [
        binary,
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'data'}",
        "--storage.tsdb.retention.time=30d",
        f"--web.listen-address=127.0.0.1:{port}",
        *extra,
    ]
    with open(folder / "prometheus.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start; see {folder / 'prometheus.log'}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def run_replay(args: argparse.Namespace, gateway_port: int) -> tuple[dict[str, Any], float]:
    """The replay's engine-time mode in this process, its gateway on `gateway_port`. Returns its records
    and the epoch at which its simulated clock read 0."""
    import uvloop

    from rolloutreplay.scenario import ReplayConfig
    from rolloutreplay.world import run_mode

    config = ReplayConfig(
        time_scale=args.time_scale,
        duration_s=args.duration,
        agents=args.agents,
        seed=args.seed,
        gateway_settings=(("port", str(gateway_port)),),
    )
    origins: list[float] = []  # the epoch of simulated time 0, from each progress report

    def progress(state: dict[str, Any]) -> None:
        origins.append(time.time() - float(state["now"]) / args.time_scale)
        if len(origins) % 20 == 1:
            print(f"  simulated {state['now']:.0f} s of {args.duration:.0f}", file=sys.stderr)

    records = uvloop.run(run_mode(config, "engine", progress))
    return records.to_json(), min(origins[:5])  # the earliest reports: before the loop could fall behind


def read_back(url: str, job: str, since: float, until: float) -> list[dict[str, Any]]:
    """Every rolloutgate sample of `job` Prometheus holds between the epochs `since` and `until`."""
    window = f"{math.ceil(until - since) + 1}s"
    selector = f'{{__name__=~"rolloutgate_.+", job="{job}"}}[{window}]'
    return list(get_json(f"{url}/api/v1/query", query=selector, time=f"{until:.3f}")["result"])


def openmetrics(series: list[dict[str, Any]], restamp: Any) -> str:
    """The series as OpenMetrics text (one family per metric name, its samples in time order), each
    timestamp mapped by `restamp`."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for one in series:
        by_name.setdefault(one["metric"]["__name__"], []).append(one)
    lines: list[str] = []
    for name, members in sorted(by_name.items()):
        lines.append(
            f"# TYPE {name} gauge"
        )  # typed as gauges: backfilled samples keep their values as scraped
        for one in members:
            labels = ",".join(
                f'{key}="{_escape(value)}"'
                for key, value in sorted(one["metric"].items())
                if key != "__name__"
            )
            for stamp, value in one["values"]:
                lines.append(f"{name}{{{labels}}} {value} {restamp(float(stamp)):.3f}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def grafana_expr(expr: str) -> str:
    """The query Grafana would send: every gateway selected, `$__rate_interval` for a 15 s scrape."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$instance"', '".+"')


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def unit_formatter(unit: str) -> FuncFormatter:
    def short(value: float) -> str:
        for bound, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
            if abs(value) >= bound:
                return f"{value / bound:.3g}{suffix}"
        return f"{value:.3g}"

    def fmt(value: float, _position: float) -> str:
        if unit == "percentunit":
            return f"{100 * value:.0f}%"
        if unit == "s":
            return f"{value / 60:.3g} min" if value >= 120 else f"{value:.3g} s"
        if unit == "Bps":
            return f"{short(value)}B/s"
        if unit.startswith("suffix:"):
            return f"{short(value)} {unit.removeprefix('suffix:').strip()}"
        return short(value)

    return FuncFormatter(fmt)


def draw_timeseries(
    ax: Axes, panel: dict[str, Any], series: list[tuple[str, list[float], list[float]]]
) -> None:
    custom = panel["fieldConfig"]["defaults"].get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    bars = custom.get("drawStyle") == "bars"
    if not series:
        ax.text(
            0.5,
            0.5,
            "no series: none in this run",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="#9e9e9e",
        )
    elif stacked:
        grid = sorted({t for _, ts, _ in series for t in ts})
        layers = [[dict(zip(ts, vs, strict=True)).get(t, 0.0) for t in grid] for _, ts, vs in series]
        colors = [STATE_COLORS.get(name) for name, _, _ in series]
        if all(colors):
            ax.stackplot(grid, layers, labels=[n for n, _, _ in series], colors=colors, alpha=0.8)
        else:
            ax.stackplot(grid, layers, labels=[n for n, _, _ in series], alpha=0.8)
    else:
        for name, ts, vs in series:
            if bars:
                ax.bar(ts, vs, width=SCRAPE_S / 60, label=name, alpha=0.85)
            else:
                ax.plot(ts, vs, label=name, linewidth=1.1, color=STATE_COLORS.get(name))
    ax.set_ylim(bottom=0)
    if panel["fieldConfig"]["defaults"].get("max") is not None:
        ax.set_ylim(top=panel["fieldConfig"]["defaults"]["max"])
    ax.yaxis.set_major_formatter(unit_formatter(panel["fieldConfig"]["defaults"]["unit"]))
    if series:
        ax.legend(loc="upper left", fontsize=6, ncol=min(4, len(series)), frameon=False)


def draw_state_timeline(ax: Axes, series: list[tuple[str, list[float], list[float]]]) -> None:
    """One band; each stretch colored by the state whose series is 1 there (Grafana's state timeline), the
    closed states drawn over the open one."""
    for name, ts, vs in sorted(series, key=lambda one: one[0] != "open"):
        color = STATE_COLORS.get(name, "#fdd835")
        for t, v in zip(ts, vs, strict=True):
            if v >= 1:
                ax.axvspan(t - SCRAPE_S / 120, t + SCRAPE_S / 120, color=color, linewidth=0)
        if ts:
            ax.plot([], [], color=color, linewidth=6, label=name)
    ax.set_yticks([])
    ax.legend(loc="upper left", fontsize=6, ncol=4, frameon=False)


def render(
    url: str, start: float, end: float, events: list[dict[str, Any]], png: Path, note: str
) -> dict[str, Any]:
    """Evaluate every panel's queries over [start, end] (epochs of the re-stamped data) and draw the grid.
    Returns what each panel's queries gave (series count and points), for the record."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.36  # inches per grid row (Grafana's 30 px)
    figure = plt.figure(figsize=(18, rows * unit_h + 0.9))
    top, bottom = 1 - 0.55 / figure.get_figheight(), 0.35 / figure.get_figheight()

    def place(grid: dict[str, int]) -> tuple[float, float, float, float]:
        """The axes' rectangle for a grid position, leaving a gutter for the title and the tick labels."""
        cell_w, cell_h = 0.985 / 24, (top - bottom) / rows
        x0, y1 = 0.01 + grid["x"] * cell_w, top - grid["y"] * cell_h
        left_pad, title_pad, tick_pad = 0.045, 0.32 / figure.get_figheight(), 0.42 / figure.get_figheight()
        return (
            x0 + left_pad,
            y1 - grid["h"] * cell_h + tick_pad,
            grid["w"] * cell_w - left_pad - 0.006,
            grid["h"] * cell_h - tick_pad - title_pad,
        )

    evaluated: dict[str, Any] = {}
    minutes = (end - start) / 60
    for panel in panels:
        grid = panel["gridPos"]
        ax = figure.add_axes(place(grid))
        series: list[tuple[str, list[float], list[float]]] = []
        for target in panel["targets"]:
            query = grafana_expr(target["expr"])
            result = get_json(
                f"{url}/api/v1/query_range", query=query, start=f"{start}", end=f"{end}", step=f"{SCRAPE_S:g}"
            )["result"]
            for one in sorted(result, key=lambda r: sorted(r["metric"].items())):
                ts = [(float(t) - start) / 60 for t, _ in one["values"]]
                vs = [float(v) for _, v in one["values"]]
                series.append((legend(target["legendFormat"], one["metric"]), ts, vs))
            evaluated[panel["title"]] = {"query": query, "series": len(result)}
        if panel["type"] == "state-timeline":
            draw_state_timeline(ax, series)
        else:
            draw_timeseries(ax, panel, series)
        for event in events:
            color, _ = EVENT_STYLE[event["kind"]]
            ax.axvline(event["at"] / 60, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
        ax.set_xlim(0, minutes)
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25, linewidth=0.5)
        if grid["y"] + grid["h"] == rows:
            ax.set_xlabel("simulated minutes", fontsize=7, labelpad=1)
    handles = [plt.Line2D([], [], color=c, linestyle="--", label=label) for c, label in EVENT_STYLE.values()]
    figure.legend(handles=handles, loc="upper right", fontsize=8, ncol=3, frameon=False)
    figure.suptitle(
        dashboard["title"] + " dashboard: " + note, x=0.01, y=0.995, ha="left", va="top", fontsize=10
    )
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return evaluated


def record(args: argparse.Namespace) -> dict[str, Any]:
    """Run the replay scraped by Prometheus and backfill its samples on the simulated clock into
    `args.out`/simulated/data. Returns what drawing needs (the run's time span and events)."""
    if args.out.exists():
        shutil.rmtree(args.out)
    gateway_port, job = free_port(), "rolloutgate"
    scrape = {
        "job_name": job,
        "scrape_interval": f"{SCRAPE_S / args.time_scale * 1000:.0f}ms",  # 15 simulated seconds
        "scrape_timeout": f"{SCRAPE_S / args.time_scale * 1000:.0f}ms",
        "static_configs": [{"targets": [f"127.0.0.1:{gateway_port}"]}],
    }
    print(
        f"replay: {args.duration:.0f} simulated s at x{args.time_scale:g}, scraped by Prometheus",
        file=sys.stderr,
    )
    with prometheus(args.prometheus, args.out / "scraped", scrape) as scraped:
        records, origin = run_replay(args, gateway_port)
        real_end = origin + records["ended_at"] / args.time_scale
        time.sleep(1.0)
        series = read_back(scraped, job, origin, real_end + 1.0)
    (args.out / "records-engine.json").write_text(json.dumps(records))
    samples = sum(len(s["values"]) for s in series)
    print(f"read back {len(series)} series, {samples} samples", file=sys.stderr)
    # on the simulated clock, ending an hour ago (inside the retention, clear of the new Prometheus' head)
    base = math.floor(time.time() - 3600 - args.duration)

    def restamp(epoch: float) -> float:
        return base + (epoch - origin) * args.time_scale

    backfill = args.out / "backfill.om"
    backfill.write_text(openmetrics(series, restamp))
    blocks = args.out / "simulated" / "data"
    blocks.mkdir(parents=True)
    subprocess.run(
        [args.promtool, "tsdb", "create-blocks-from", "openmetrics", str(backfill), str(blocks)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    run = {
        "start": base,
        "end": base + records["ended_at"],
        "duration_s": args.duration,
        "time_scale": args.time_scale,
        "series": len(series),
        "samples": samples,
        "events": [e for e in records["events"] if e["kind"] in EVENT_STYLE],
    }
    (args.out / "run.json").write_text(json.dumps(run, indent=2))
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("out/dashboard"), help="work folder (Prometheus data, records)"
    )
    parser.add_argument("--png", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--time-scale", type=float, default=24.0, help="simulated seconds per real second")
    parser.add_argument("--duration", type=float, default=2400.0, help="simulated seconds of replay")
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redraw", action="store_true", help="draw again from the data a run left in --out")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    parser.add_argument("--promtool", default=shutil.which("promtool") or "promtool")
    args = parser.parse_args(argv)
    run = json.loads((args.out / "run.json").read_text()) if args.redraw else record(args)
    note = (
        f"its queries evaluated by Prometheus on a {run['duration_s'] / 60:.0f}-minute incident replay at "
        f"x{run['time_scale']:g} (scripts/render_dashboard.py; not a Grafana screenshot)"
    )
    # Backfilled blocks carry no staleness markers (a scrape writes one when a series disappears, e.g. an
    # engine's state label changing): a lookback of 1.5 scrape intervals ends a vanished series as they would.
    lookback = f"--query.lookback-delta={1.5 * SCRAPE_S * 1000:.0f}ms"
    with prometheus(args.prometheus, args.out / "simulated", None, lookback) as served:
        evaluated = render(served, run["start"], run["end"], run["events"], args.png, note)
    (args.out / "panels.json").write_text(json.dumps(evaluated, indent=2))
    empty = [title for title, got in evaluated.items() if not got["series"]]
    print(f"wrote {args.png}; panels without data: {', '.join(empty) or 'none'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
