"""Hand-made snapshots for the view model's tests: a gateway's state and metrics as the gateway writes them."""

from __future__ import annotations

from typing import Any

from rolloutgate.top.snapshot import GatewaySnapshot, parse_metrics

URL = "http://gw"


def engine(engine_id: str = "engine-0", **fields: Any) -> dict[str, Any]:
    """An `/admin/state` engine entry: healthy, idle, unless `fields` say otherwise."""
    entry: dict[str, Any] = {
        "id": engine_id,
        "url": f"http://{engine_id}",
        "capacity": 8,
        "healthy": True,
        "state": "healthy",
        "paused_by_engine": False,
        "running": 0,
        "queued": 0,
        "prefilling": False,
        "quarantined": False,
        "paused_by_gate": False,
        "generated_tokens": 0,
        "silent_s": None,
        "hung_after_s": None,
    }
    entry.update(fields)
    return entry


def metrics_text(
    *,
    generated: float = 0,
    failures: dict[str, float] | None = None,
    quarantines: dict[str, float] | None = None,
    clocks: dict[str, tuple[float, float]] | None = None,
    wasted: dict[str, float] | None = None,
    prompt_tokens: dict[str, float] | None = None,
    cached_tokens: dict[str, float] | None = None,
) -> str:
    """Prometheus text with the series the view reads; `clocks`: clock -> (count, sum)."""
    lines = ["# TYPE rolloutgate_generated_tokens counter", f"rolloutgate_generated_tokens_total {generated}"]

    def counter(name: str, label: str, values: dict[str, float] | None) -> None:
        if values is None:
            return
        lines.append(f"# TYPE {name} counter")
        lines.extend(f'{name}_total{{{label}="{k}"}} {v}' for k, v in values.items())

    counter("rolloutgate_failures", "reason", failures)
    counter("rolloutgate_engine_quarantines", "engine", quarantines)
    counter("rolloutgate_wasted_engine_seconds", "reason", wasted)
    counter("rolloutgate_engine_prompt_tokens", "engine", prompt_tokens)
    counter("rolloutgate_engine_cached_tokens", "engine", cached_tokens)
    if clocks is not None:
        lines.append("# TYPE rolloutgate_clock_seconds histogram")
        for clock, (count, total) in clocks.items():
            lines.append(f'rolloutgate_clock_seconds_bucket{{clock="{clock}",le="+Inf"}} {count}')
            lines.append(f'rolloutgate_clock_seconds_count{{clock="{clock}"}} {count}')
            lines.append(f'rolloutgate_clock_seconds_sum{{clock="{clock}"}} {total}')
    return "\n".join(lines) + "\n"


def snapshot(
    at: float,
    engines: list[dict[str, Any]] | None = None,
    *,
    url: str = URL,
    replica_id: str | None = None,
    queue_depth: int = 0,
    gate: dict[str, Any] | None = None,
    **metrics: Any,
) -> GatewaySnapshot:
    state = {
        "gate": gate or {"open": True, "mode": None, "closed_for_s": None, "last_update": None},
        "queue_depth": queue_depth,
        "in_flight": {},
        "engines": engines if engines is not None else [engine()],
    }
    return GatewaySnapshot(
        url=url,
        replica_id=replica_id,
        taken_at=at,
        state=state,
        samples=parse_metrics(metrics_text(**metrics)),
    )


def unreachable(at: float, *, url: str = URL, replica_id: str | None = None) -> GatewaySnapshot:
    return GatewaySnapshot(url=url, replica_id=replica_id, taken_at=at, error="connection refused")
