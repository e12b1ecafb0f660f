"""The view model of `rolloutgate top`: snapshots in, rows and rates out (sans-IO, no terminal, no clock).

Theory of operation: the reader keeps the snapshots of the last `window` seconds (each a list, one per
gateway: one for a lone gateway, one per replica of a fleet). `build_view(history)` reads three of them:

    current   history[-1]   what is shown: engine states, load, the queue, totals
    previous  history[-2]   instantaneous rates: tokens/s (overall and per engine)
    oldest    history[0]    rates over the window: failures per minute, the clocks' split of the requests
                            that finished in it, wasted engine-seconds per second, prefix-cache hit rates

Every rate is a counter's delta over the snapshots' own time stamps, per gateway (a replica read later than
another has its own interval), summed over gateways; a counter that went down (the gateway restarted) counts
from zero. A rate needs two readings of the same gateway: with one, it is None (shown "-"); so is any figure
whose metric the gateway does not export (a part not deployed, an older version).

An engine's state, first match wins: quarantined (the core caught it hung), unhealthy (failed health checks),
paused by the trainer (the engine says so), paused by the gate, hung (silent, with work, for at least
HUNG_SHARE of the window after which the core quarantines it: a person sees it coming), prefilling (a long
prefill in progress), healthy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutgate.top.snapshot import GatewaySnapshot, MetricSamples

__all__ = (
    "HUNG_SHARE",
    "ClockSplit",
    "EngineRow",
    "GatewayRow",
    "TopView",
    "build_view",
    "engine_state",
)

HUNG_SHARE = 0.25  # silent this share of its stall window: shown hung (progress normally comes within 1/20)
SPLIT_CLOCKS = ("queue", "paused", "contention", "charged")  # the parts of a request's wall clock
TIMEOUT_REASONS = ("timeout", "queue_timeout", "max_wall")  # FailReason values of time budgets
STALL_REASONS = ("stall",)

GENERATED = "rolloutgate_generated_tokens_total"
FAILURES = "rolloutgate_failures_total"
QUARANTINES = "rolloutgate_engine_quarantines_total"
CLOCK_SUM = "rolloutgate_clock_seconds_sum"
CLOCK_COUNT = "rolloutgate_clock_seconds_count"
WASTED = "rolloutgate_wasted_engine_seconds_total"
PROMPT_TOKENS = "rolloutgate_engine_prompt_tokens_total"
CACHED_TOKENS = "rolloutgate_engine_cached_tokens_total"

History = Sequence[Sequence[GatewaySnapshot]]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRow:
    replica: str | None  # the fleet replica that owns it; None for a lone gateway
    engine_id: str
    url: str
    state: str  # see the module docstring
    running: int | None
    capacity: float | None
    queued: int | None
    tokens_per_s: float | None
    is_prefilling: bool
    silent_s: float | None  # since its last progress, while it has work and is judged
    hung_after_s: float | None  # silent this long: quarantined
    cache_hit_rate: float | None  # prompt tokens served from its prefix cache, over the window


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayRow:
    key: str  # replica id, or URL
    url: str
    error: str | None  # why it could not be read
    gate: str  # "open" or "closed (<mode>) <s>s"
    queue_depth: int
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockSplit:
    """The clocks of the requests that finished over `span_s` (None: since each gateway started)."""

    requests: float
    wall_s: float
    parts_s: Mapping[str, float]  # SPLIT_CLOCKS -> summed seconds
    span_s: float | None

    def share(self, clock: str) -> float | None:
        return self.parts_s[clock] / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class TopView:
    gateways: tuple[GatewayRow, ...]
    engines: tuple[EngineRow, ...]
    queue_depth: int
    in_flight: int
    capacity: float
    tokens_per_s: float | None
    timeouts_per_min: float | None
    stalls_per_min: float | None
    quarantines_per_min: float | None
    failures_per_min: Mapping[str, float] | None  # every reason, over the window
    split: ClockSplit
    wasted_engine_s: float | None  # since start, summed; None if no gateway exports it
    wasted_by_reason: Mapping[str, float]
    wasted_per_s: float | None  # over the window
    window_s: float | None  # the span of the window's rates


def build_view(history: History) -> TopView:
    """The view of the newest snapshots in `history` (oldest first; at least one entry)."""
    current = history[-1]
    previous = _by_key(history[-2]) if len(history) > 1 else {}
    oldest = _by_key(history[0]) if len(history) > 1 else {}
    readable = [s for s in current if s.error is None]
    engines = tuple(
        row for snapshot in current for row in _engine_rows(snapshot, previous.get(snapshot.key), oldest)
    )
    wasted_exported = any(s.samples.has(WASTED) for s in readable)
    return TopView(
        gateways=tuple(_gateway_row(s) for s in current),
        engines=engines,
        queue_depth=sum(_int(s.state.get("queue_depth")) for s in readable),
        in_flight=sum(row.running or 0 for row in engines),
        capacity=sum(row.capacity or 0 for row in engines),
        tokens_per_s=_sum_rates(current, previous, lambda s: s.samples.total(GENERATED)),
        timeouts_per_min=_per_min(current, oldest, lambda s: _reasons(s.samples, TIMEOUT_REASONS)),
        stalls_per_min=_per_min(current, oldest, lambda s: _reasons(s.samples, STALL_REASONS)),
        quarantines_per_min=_per_min(current, oldest, lambda s: s.samples.total(QUARANTINES)),
        failures_per_min=_failures_per_min(current, oldest),
        split=_split(current, oldest),
        wasted_engine_s=sum(s.samples.total(WASTED) for s in readable) if wasted_exported else None,
        wasted_by_reason=_summed(s.samples.by_label(WASTED, "reason") for s in readable),
        wasted_per_s=_sum_rates(current, oldest, lambda s: s.samples.total(WASTED))
        if wasted_exported
        else None,
        window_s=_span(current, oldest),
    )


def engine_state(engine: Mapping[str, Any]) -> str:
    """One engine of `/admin/state` as a person names its state (the module docstring's order)."""
    state = engine.get("state")
    if engine.get("quarantined") or state == "quarantined":
        return "quarantined"
    if state is None:
        return "joining"  # the core does not know it yet
    if state != "healthy":
        return str(state)
    if engine.get("paused_by_engine"):
        return "paused by trainer"
    if engine.get("paused_by_gate"):
        return "paused by gate"
    silent_s, hung_after_s = _opt_num(engine.get("silent_s")), _opt_num(engine.get("hung_after_s"))
    if silent_s is not None and hung_after_s is not None and silent_s >= HUNG_SHARE * hung_after_s:
        return "hung"
    if engine.get("prefilling"):
        return "prefilling"
    return "healthy"


# --- rows -------------------------------------------------------------------------------------------------


def _engine_rows(
    snapshot: GatewaySnapshot, previous: GatewaySnapshot | None, oldest: Mapping[str, GatewaySnapshot]
) -> list[EngineRow]:
    replica = snapshot.replica_id
    if snapshot.error is not None:
        return []
    before = _engines_by_id(previous) if previous is not None else {}
    dt = snapshot.taken_at - previous.taken_at if previous is not None else 0.0
    start = oldest.get(snapshot.key)
    rows = []
    for engine in snapshot.engines:
        engine_id = str(engine.get("id", "?"))
        url = str(engine.get("url", ""))
        earlier = before.get(engine_id)
        tokens_per_s = None
        if earlier is not None and dt > 0 and "generated_tokens" in engine:
            tokens_per_s = (
                _delta(_num(engine.get("generated_tokens")), _num(earlier.get("generated_tokens"))) / dt
            )
        rows.append(
            EngineRow(
                replica=replica,
                engine_id=engine_id,
                url=url,
                state=engine_state(engine),
                running=_opt_int(engine.get("running")),
                capacity=_opt_num(engine.get("capacity")),
                queued=_opt_int(engine.get("queued")),
                tokens_per_s=tokens_per_s,
                is_prefilling=bool(engine.get("prefilling")),
                silent_s=_opt_num(engine.get("silent_s")),
                hung_after_s=_opt_num(engine.get("hung_after_s")),
                cache_hit_rate=_cache_hit_rate(snapshot, start, (engine_id, url)),
            )
        )
    return rows


def _gateway_row(snapshot: GatewaySnapshot) -> GatewayRow:
    gate = snapshot.state.get("gate")
    text = "?"
    if isinstance(gate, dict):
        if gate.get("open"):
            text = "open"
        else:
            closed_for = gate.get("closed_for_s")
            text = f"closed ({gate.get('mode')})" + (f" {closed_for:.0f}s" if _is_number(closed_for) else "")
    running = sum(_int(e.get("running")) for e in snapshot.engines)
    return GatewayRow(
        key=snapshot.key,
        url=snapshot.url,
        error=snapshot.error,
        gate=text,
        queue_depth=_int(snapshot.state.get("queue_depth")),
        in_flight=running,
    )


def _cache_hit_rate(
    snapshot: GatewaySnapshot, start: GatewaySnapshot | None, names: tuple[str, str]
) -> float | None:
    """Cached over prompt tokens on the engine (labelled by id or URL) over the window, else since start."""
    samples = snapshot.samples
    if not samples.has(PROMPT_TOKENS) or not samples.has(CACHED_TOKENS):
        return None
    for name in names:
        prompt = samples.by_label(PROMPT_TOKENS, "engine").get(name)
        if prompt is None:
            continue
        cached = samples.by_label(CACHED_TOKENS, "engine").get(name, 0.0)
        if start is not None and start.error is None:
            prompt_before = start.samples.by_label(PROMPT_TOKENS, "engine").get(name, 0.0)
            cached_before = start.samples.by_label(CACHED_TOKENS, "engine").get(name, 0.0)
            if prompt - prompt_before > 0:
                return _delta(cached, cached_before) / _delta(prompt, prompt_before)
        return cached / prompt if prompt > 0 else None
    return None


# --- rates ------------------------------------------------------------------------------------------------


def _split(current: Sequence[GatewaySnapshot], oldest: Mapping[str, GatewaySnapshot]) -> ClockSplit:
    """Over the window where every readable gateway has a reading at its start; since start otherwise."""
    readable = [s for s in current if s.error is None]
    starts = [oldest.get(s.key) for s in readable]
    windowed = bool(readable) and all(s is not None and s.error is None for s in starts)
    span = _span(current, oldest) if windowed else None

    def clocks(snapshot: GatewaySnapshot) -> tuple[float, float, list[float]]:
        samples = snapshot.samples
        count = samples.total(CLOCK_COUNT, clock="wall")
        wall = samples.total(CLOCK_SUM, clock="wall")
        return count, wall, [samples.total(CLOCK_SUM, clock=c) for c in SPLIT_CLOCKS]

    requests, wall, parts = 0.0, 0.0, [0.0] * len(SPLIT_CLOCKS)
    for snapshot, start in zip(readable, starts, strict=True):
        count, wall_s, parts_s = clocks(snapshot)
        if windowed and start is not None:
            count0, wall0, parts0 = clocks(start)
            count, wall_s = _delta(count, count0), _delta(wall_s, wall0)
            parts_s = [_delta(now, then) for now, then in zip(parts_s, parts0, strict=True)]
        requests += count
        wall += wall_s
        parts = [a + b for a, b in zip(parts, parts_s, strict=True)]
    return ClockSplit(
        requests=requests, wall_s=wall, parts_s=dict(zip(SPLIT_CLOCKS, parts, strict=True)), span_s=span
    )


def _failures_per_min(
    current: Sequence[GatewaySnapshot], oldest: Mapping[str, GatewaySnapshot]
) -> dict[str, float] | None:
    reasons = {r for s in current if s.error is None for r in s.samples.by_label(FAILURES, "reason")}
    out: dict[str, float] = {}
    for reason in sorted(reasons):
        rate = _per_min(current, oldest, _failures_of(reason))
        if rate is None:
            return None
        out[reason] = rate
    return out if _span(current, oldest) is not None else None


def _failures_of(reason: str) -> Callable[[GatewaySnapshot], float]:
    return lambda snapshot: snapshot.samples.total(FAILURES, reason=reason)


def _per_min(
    current: Sequence[GatewaySnapshot],
    earlier: Mapping[str, GatewaySnapshot],
    read: Callable[[GatewaySnapshot], float],
) -> float | None:
    rate = _sum_rates(current, earlier, read)
    return None if rate is None else rate * 60.0


def _sum_rates(
    current: Sequence[GatewaySnapshot],
    earlier: Mapping[str, GatewaySnapshot],
    read: Callable[[GatewaySnapshot], float],
) -> float | None:
    """The per-second rate of `read` between each gateway's two readings, summed; None if none has two."""
    total, found = 0.0, False
    for snapshot in current:
        before = earlier.get(snapshot.key)
        if snapshot.error is not None or before is None or before.error is not None:
            continue
        dt = snapshot.taken_at - before.taken_at
        if dt <= 0:
            continue
        total += _delta(read(snapshot), read(before)) / dt
        found = True
    return total if found else None


def _span(current: Sequence[GatewaySnapshot], earlier: Mapping[str, GatewaySnapshot]) -> float | None:
    spans = [
        s.taken_at - earlier[s.key].taken_at
        for s in current
        if s.key in earlier and s.taken_at > earlier[s.key].taken_at
    ]
    return max(spans) if spans else None


def _reasons(samples: MetricSamples, reasons: Sequence[str]) -> float:
    return sum(samples.total(FAILURES, reason=r) for r in reasons)


def _delta(now: float, then: float) -> float:
    """A counter's growth; one that went down was reset (the gateway restarted) and counts from zero."""
    return now - then if now >= then else now


def _summed(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _by_key(snapshots: Sequence[GatewaySnapshot]) -> dict[str, GatewaySnapshot]:
    return {s.key: s for s in snapshots}


def _engines_by_id(snapshot: GatewaySnapshot) -> dict[str, Mapping[str, Any]]:
    return {str(e.get("id")): e for e in snapshot.engines}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _opt_num(value: object) -> float | None:
    """A JSON number as a float; None for anything else (absent, null, a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _num(value: object) -> float:
    number = _opt_num(value)
    return 0.0 if number is None else number


def _opt_int(value: object) -> int | None:
    number = _opt_num(value)
    return None if number is None else int(number)


def _int(value: object) -> int:
    return int(_num(value))
