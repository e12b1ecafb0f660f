"""A recorded trace (`rolloutgate serve --record-trace FILE`, server/trace.py) as the replay's workload.

Theory of operation: `read_trace` checks the header's version and keeps the request lines and the gateway's
events. `TraceWorkload` turns them into what the incident replay runs (world.py), so that `rolloutgate replay
trace FILE` compares both clock modes on an operator's own traffic with the same table and figure:

- sessions: a session's requests (by routing key; a request without one is a session of its own) in arrival
  order, a request that repeats the previous one's prompt and `max_tokens` after it did not end well being the
  client's retry of the same turn (the replay's client, LiteLLM, retries by itself);
- turns, closed loop: a session starts at its first arrival; each later turn is sent the recorded gap (the
  client's think or tool time) after the previous turn's answer, so a slower gateway delays the session as it
  delayed the real one; its prompt grows to the recorded length (each turn's prompt extends the previous one,
  so the engines' prefix cache behaves as it did); a failed turn ends its session, as in the scenario;
- agents: the sessions of one `user` (OpenAI's end-user field) run one after another, each starting the
  recorded gap after the previous one ended; sessions without a user start at their recorded arrival;
- turn kinds, for the figures (measure.py): a session's first turn is `opening` (`storm` in a storm), a later
  one `long` when its `max_tokens` would not fit the client timeout at the trace's median decode rate
  (output tokens per charged second of the answered requests), else `medium`;
- events: the gate closing is a weight update at that time; an engine the gateway marked quarantined or
  unhealthy and never healthy again froze (the gateway cannot see a freeze, only its effect) `stall_timeout`
  (quarantined; version 1 traces: plus `hang_check_timeout`) or `health_failures` x `health_interval`
  (unhealthy) before the mark, and freezes there in the replay; a storm is at least one new ~100K-token session per engine arriving within `STORM_WINDOW_S`, a
  marker for the figures (the trace brings its sessions). An engine that recovered, a staggered per-engine
  pause and the weight update's own duration are not replayed (the simulator's update takes its 25 s).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rolloutgate.server.trace import TRACE_VERSION
from rolloutreplay.measure import LARGE_PREFILL_TOKENS
from rolloutreplay.scenario import (
    AgentPlan,
    ReplayConfig,
    ScenarioEvent,
    SessionPlan,
    TurnPlan,
)

__all__ = (
    "STORM_WINDOW_S",
    "Trace",
    "TraceError",
    "TraceWorkload",
    "TracedAgent",
    "read_trace",
    "trace_config",
)

STORM_WINDOW_S = 1.0
# the agents' first message besides the history ("Task of session ...: work through it step by step.")
_TASK_MESSAGE_TOKENS = 15
_LOST_STATES = ("quarantined", "unhealthy")
READS = (1, TRACE_VERSION)  # the trace versions read (server/trace.py says what changed)
_DEFAULTS = ReplayConfig()


class TraceError(ValueError):
    """The file is not a trace this version reads; the message names the line."""


@dataclass(frozen=True, slots=True)
class Trace:
    header: dict[str, Any]
    requests: list[dict[str, Any]]  # by arrival
    events: list[dict[str, Any]]  # engine, engine_pause and gate lines, by time

    @property
    def engine_urls(self) -> list[str]:
        """The header's engines, then any other engine the lines name, in order of appearance."""
        urls = [str(u) for u in self.header.get("engines", [])]
        for line in [*self.requests, *self.events]:
            url = line.get("engine")
            if isinstance(url, str) and url not in urls:
                urls.append(url)
        return urls

    @property
    def duration_s(self) -> float:
        ends = [float(r["end"]) for r in self.requests] + [float(e["at"]) for e in self.events]
        return max(ends, default=0.0)

    @property
    def version(self) -> int:
        return int(self.header["rolloutgate_trace"])

    def setting(self, name: str, default: float) -> float:
        return float(self.header.get("settings", {}).get(name, default))


def read_trace(path: str | Path) -> Trace:
    """The trace at `path`. Raises TraceError (a bad header, version or line) or OSError."""
    header: dict[str, Any] | None = None
    requests: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not JSON ({exc})") from None
            if header is None:
                if not isinstance(line, dict) or "rolloutgate_trace" not in line:
                    raise TraceError(f"{path}:{number}: not a rolloutgate trace (no header line)")
                if line["rolloutgate_trace"] not in READS:
                    raise TraceError(
                        f"{path}: trace version {line['rolloutgate_trace']}, this version reads {READS}"
                    )
                header = line
            elif line.get("type") == "request":
                for key in ("at", "end", "prompt_tokens"):
                    if not isinstance(line.get(key), int | float):
                        raise TraceError(f"{path}:{number}: a request line needs a number {key!r}")
                requests.append(line)
            elif line.get("type") in ("engine", "engine_pause", "gate"):
                events.append(line)
    if header is None:
        raise TraceError(f"{path}: empty")
    requests.sort(key=lambda r: float(r["at"]))
    events.sort(key=lambda e: float(e["at"]))
    return Trace(header=header, requests=requests, events=events)


@dataclass(slots=True)
class _Turn:
    at: float
    end: float
    prompt_tokens: int
    max_tokens: int
    ok: bool


@dataclass(slots=True)
class _Session:
    key: str
    user: str | None
    turns: list[_Turn] = field(default_factory=list)

    @property
    def start(self) -> float:
        return self.turns[0].at


def _is_retry(previous: _Turn, request: dict[str, Any]) -> bool:
    return (
        not previous.ok
        and previous.prompt_tokens == request["prompt_tokens"]
        and previous.max_tokens == _max_tokens(request)
    )


def _max_tokens(request: dict[str, Any]) -> int:
    limit = request.get("max_tokens")
    return int(limit) if isinstance(limit, int) else max(1, int(request.get("output_tokens") or 1))


def _sessions(requests: Iterable[dict[str, Any]]) -> list[_Session]:
    by_key: dict[str, _Session] = {}
    for request in requests:
        key = request.get("session") or f"request {request.get('id')}"
        session = by_key.setdefault(key, _Session(key=key, user=request.get("user")))
        ok = request.get("outcome") == "ok" and not request.get("client_left")
        turn = _Turn(
            at=float(request["at"]),
            end=float(request["end"]),
            prompt_tokens=int(request["prompt_tokens"]),
            max_tokens=_max_tokens(request),
            ok=ok,
        )
        if session.turns and _is_retry(session.turns[-1], request):
            session.turns[-1] = _Turn(
                at=session.turns[-1].at,
                end=turn.end,
                prompt_tokens=turn.prompt_tokens,
                max_tokens=turn.max_tokens,
                ok=ok,
            )
        else:
            session.turns.append(turn)
    return sorted(by_key.values(), key=lambda s: s.start)


class TracedAgent(AgentPlan):
    """An agent of the replay (agents.py `AgentFleet.start_agent`) playing recorded sessions in order, where
    the scenario's agent draws its own."""

    def __init__(self, start_s: float, sessions: list[SessionPlan]) -> None:
        self.start_s = start_s
        self.sessions = sessions
        self._next = 0

    def next_session(self) -> SessionPlan:
        session = self.sessions[self._next]
        self._next += 1
        return session


class TraceWorkload:
    """The agents and the scripted events of a trace (module docstring), for `config` (its client timeout,
    its reply excerpt kept in the history)."""

    def __init__(self, trace: Trace, config: ReplayConfig) -> None:
        self.trace = trace
        self.config = config
        self.sessions = _sessions(trace.requests)
        self.storms = self._storms()
        self._rate = self._decode_rate()

    @classmethod
    def read(cls, path: str | Path, config: ReplayConfig) -> TraceWorkload:
        return cls(read_trace(path), config)

    def agents(self) -> list[tuple[str, TracedAgent]]:
        """(name, agent) of every agent: one per user, one per session without a user."""
        by_user: dict[str, list[_Session]] = {}
        alone: list[_Session] = []
        for session in self.sessions:
            (by_user.setdefault(session.user, []) if session.user else alone).append(session)
        groups = [*by_user.values(), *([s] for s in alone)]
        groups.sort(key=lambda g: g[0].start)
        return [
            (f"t{index:03d}", TracedAgent(group[0].start, self._plans(group)))
            for index, group in enumerate(groups)
        ]

    def _plans(self, group: list[_Session]) -> list[SessionPlan]:
        plans = []
        for number, session in enumerate(group):
            following = group[number + 1] if number + 1 < len(group) else None
            plans.append(self._plan(session, following))
        return plans

    def _plan(self, session: _Session, following: _Session | None) -> SessionPlan:
        kept = self.config.reply_kept_tokens
        in_storm = any(s <= session.start < s + STORM_WINDOW_S for s, _ in self.storms)
        turns = []
        for number, turn in enumerate(session.turns):
            if number + 1 < len(session.turns):
                after = session.turns[number + 1]
                gap, grown = after.at - turn.end, after.prompt_tokens - turn.prompt_tokens
            else:  # the session's last turn: the gap before the same user's next session
                gap, grown = (0.0 if following is None else following.start - turn.end), 0
            tool = max(0, grown - min(kept, turn.max_tokens))
            turns.append(
                TurnPlan(
                    kind=self._kind(number, turn, in_storm),
                    max_tokens=turn.max_tokens,
                    tool_time_s=max(0.0, gap),
                    tool_tokens=tool,
                )
            )
        history = max(1, session.turns[0].prompt_tokens - _TASK_MESSAGE_TOKENS)
        return SessionPlan(history_tokens=history, turns=tuple(turns))

    def _kind(self, number: int, turn: _Turn, in_storm: bool) -> str:
        if number == 0:
            return "storm" if in_storm else "opening"
        fits = self._rate <= 0 or turn.max_tokens / self._rate <= self.config.client_timeout_s
        return "medium" if fits else "long"

    def _decode_rate(self) -> float:
        """Median output tokens per charged second of the answered requests (0: none to tell)."""
        rates = [
            float(r["output_tokens"]) / float(r["timing"]["charged_s"])
            for r in self.trace.requests
            if r.get("outcome") == "ok"
            and (r.get("output_tokens") or 0) > 0
            and isinstance(r.get("timing"), dict)
            and (r["timing"].get("charged_s") or 0) > 0
        ]
        return statistics.median(rates) if rates else 0.0

    def _storms(self) -> list[tuple[float, int]]:
        """(first arrival, sessions) of each burst of new large-prompt sessions, one per engine or more."""
        engines = max(1, len(self.trace.engine_urls))
        starts = sorted(s.start for s in self.sessions if s.turns[0].prompt_tokens >= LARGE_PREFILL_TOKENS)
        storms: list[tuple[float, int]] = []
        index = 0
        while index < len(starts):
            burst = [t for t in starts[index:] if t < starts[index] + STORM_WINDOW_S]
            if len(burst) >= engines:
                storms.append((starts[index], len(burst)))
                index += len(burst)
            else:
                index += 1
        return storms

    def events(self) -> list[ScenarioEvent]:
        """The scripted events of the replay, in time order (module docstring)."""
        events = [
            # a marker: the trace brings the storm's sessions, the replay starts none of its own
            ScenarioEvent(kind="storm", at_s=at, detail={"sessions": 0, "wave": wave, "traced_sessions": n})
            for wave, (at, n) in enumerate(self.storms)
        ]
        events += [
            ScenarioEvent(kind="update", at_s=float(e["at"]))
            for e in self.trace.events
            if e["type"] == "gate" and e.get("state") == "closed"
        ]
        events += self._freezes()
        return sorted(events, key=lambda e: e.at_s)

    def _freezes(self) -> list[ScenarioEvent]:
        urls = self.trace.engine_urls
        lost: dict[str, dict[str, Any]] = {}  # engine -> its first mark since it was last healthy
        for event in self.trace.events:
            engine = event.get("engine")
            if event["type"] != "engine" or not isinstance(engine, str):
                continue
            if event.get("state") in _LOST_STATES:
                lost.setdefault(engine, event)
            else:
                lost.pop(engine, None)
        trace = self.trace
        freezes = []
        for engine, mark in lost.items():
            if mark["state"] == "quarantined":
                before = trace.setting("stall_timeout", self.config.stall_timeout_s)
                if trace.version == 1:  # its gateway asked the pause check after the stall window
                    before += trace.setting("hang_check_timeout", 0.0)
            else:
                before = trace.setting("health_failures", 3) * trace.setting("health_interval", 5.0)
            at = max(0.0, float(mark["at"]) - before)
            freezes.append(ScenarioEvent(kind="freeze", at_s=at, detail={"engine": urls.index(engine)}))
        return freezes


def trace_config(path: str | Path, **overrides: Any) -> ReplayConfig:
    """The replay's configuration for the trace at `path`: its engines, its duration, the gateway settings
    it was recorded with (timeout, stall_timeout, warmup_timeout), then `overrides` (ReplayConfig fields)."""
    trace = read_trace(path)
    agents = len(TraceWorkload(trace, _DEFAULTS).agents())
    fields: dict[str, Any] = {
        "trace": str(path),
        "engines": max(2, len(trace.engine_urls)),
        "agents": max(1, agents),
        "duration_s": max(1.0, trace.duration_s),
        "gateway_timeout_s": trace.setting("timeout", _DEFAULTS.gateway_timeout_s),
        "stall_timeout_s": trace.setting("stall_timeout", _DEFAULTS.stall_timeout_s),
    }
    warmup = trace.header.get("settings", {}).get("warmup_timeout")
    if warmup is not None:  # as a gateway setting, before any the caller gives
        given = tuple(overrides.pop("gateway_settings", ()))
        fields["gateway_settings"] = (("warmup_timeout", f"{float(warmup):g}"), *given)
    return ReplayConfig(**(fields | overrides))
