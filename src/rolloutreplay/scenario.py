"""The incident scenario: its settings, its timeline of scripted events, and each agent's deterministic plan.

Theory of operation: everything the replay does is decided here from `ReplayConfig` and its seed, before any
engine starts, so that both modes (engine time and wallclock) face exactly the same workload: the same agents
with the same sessions and turn lengths, the same storm waves, the same weight update and the same freeze. Only
what the gateway does with them differs. All times are simulated seconds from the start of the run.

What the incident contained (shared/DESIGN.md) and how it appears here:

- long decodes: a share of the turns decode ~24K tokens, about 460 s at the ~52 tok/s an engine gives each of
  its 3-4 long-context decodes (a lone request gets ~70 tok/s);
- new sessions arriving with ~100K-token histories: every session starts with a history of 90-110K tokens
  (nothing cached), and storm waves bring `storm_sessions` new sessions at once;
- a weight update in the middle (`update_at`): through the gateway's gate in engine-time mode, a plain pause
  of every engine in wallclock mode; the engines take `weight_update_s` (25 s) to load it;
- one engine that freezes for good partway through (`freeze_at`).

With `version_faults` (docs/rl.md, "A replay with a restart on old weights and a failed update"), two more
faults of an RL fleet's weights: at the update, engine `update_fail_engine`'s update fails (the simulator's
`update_fails` fault: it answers `success: false` and keeps its old weights), and at `restart_at` engine
`restart_engine` restarts (the `restart` fault: its port closed `restart_down_s`, then `restart_starting_s`
loading, then it serves holding the checkpoint it was launched with, not the update). The engine-time gateway
runs with `--version-policy latest-only`; the wallclock proxy knows no versions (its default, `any`).

The client is LiteLLM as in the incident: non-streaming, `timeout=300 s` (a read timeout: for a non-streaming
request that receives nothing until its answer, the whole turn), default retries (3 attempts).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = (
    "MODES",
    "PREFILL_ADMISSION_OFF",
    "AgentPlan",
    "ReplayConfig",
    "ScenarioEvent",
    "TurnPlan",
    "agent_plan",
    "timeline",
)

MODES = ("engine", "wallclock")
# the gateway's settings as it was before prefill-aware admission (`--no-prefill-admission`, docs/prefill.md):
# session affinity, no prefill budget, no rest
PREFILL_ADMISSION_OFF: dict[str, Any] = {
    "placement": "session_affinity",
    "prefill_budget_tokens": 0,
    "prefill_rest_ratio": 0.0,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """One replay. Durations are simulated seconds; `time_scale` simulated seconds pass per real second."""

    time_scale: float = 24.0
    agents: int = 12
    duration_s: float = 2400.0
    engines: int = 4
    seed: int = 0
    sessions: bool = False  # agents use the gateway's session API (/sessions/{id}/v1)
    prefill_admission: bool = True  # engine-time gateway with prefill-aware admission (docs/prefill.md)
    record_token_times: bool = False  # each generation's token times in the records (prefill benchmarks)
    # session token budgets (docs/rl.md): each session carries this max_seq_len (`POST /sessions` with
    # --sessions, else the X-Rolloutgate-Max-Seq-Len header on each turn); None: no budget
    max_seq_len: int | None = None
    # GRPO groups (docs/rl.md): each storm wave is one group, the n samples of one prompt: its sessions share
    # one history and carry one group id (X-Rolloutgate-Group), so the gateway places them together
    groups: bool = False
    # trace capture and replay (rolloutreplay/trace_workload.py, docs/replay.md)
    record_trace: str | None = None  # a folder: each mode's gateway writes trace-<mode>.jsonl there
    trace: str | None = None  # a trace to replay: its sessions and events instead of the scenario's
    gateway_settings: tuple[tuple[str, str], ...] = ()  # more gateway settings: (name, value as text)
    # clients and gateways (as in the incident)
    client_timeout_s: float = 300.0
    gateway_timeout_s: float = 600.0
    stall_timeout_s: float = 60.0
    # workload
    history_tokens: tuple[int, int] = (90_000, 110_000)  # a new session's history
    opening_tokens: tuple[int, int] = (2_000, 4_000)  # decode of a session's first turn
    medium_tokens: tuple[int, int] = (7_000, 13_000)  # decode of an ordinary turn
    long_tokens: tuple[int, int] = (23_000, 25_000)  # decode of a long turn (~460 s)
    long_share: float = 0.35
    turns_per_session: int = 4
    tool_tokens: int = 1_000  # the tool result appended after each turn
    reply_kept_tokens: int = 1_000  # how much of each answer stays in the history
    tool_time_s: tuple[float, float] = (5.0, 20.0)  # between two turns of a session
    start_spread_s: float = 90.0  # agents start over this window
    # scripted events, as fractions of the duration
    storm_sessions: int = 8
    storm_tokens: tuple[int, int] = (1_000, 2_000)  # decode of a storm session's only turn
    storms_at: tuple[float, ...] = (0.22, 0.62)
    update_at: float = 0.45
    freeze_at: float = 0.72
    freeze_engine: int = -1  # index; negative counts from the end
    # weight faults (module docstring)
    version_faults: bool = False
    update_fail_engine: int = 0  # its update fails (index; negative counts from the end)
    restart_engine: int = 1  # restarts onto its launch weights after the update
    restart_at: float = 0.55  # fraction of the duration
    restart_down_s: float = 20.0  # its port closed
    restart_starting_s: float = 40.0  # then loading: health and generation answer 503
    # the engine-time update's `on_failure` (keep, exclude, rollback); None: not sent, the gateway's default
    update_on_failure: str | None = None

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or not self.duration_s > 0:
            raise ValueError("time_scale and duration_s must be > 0")
        if self.agents < 1 or self.engines < 2:
            raise ValueError("a replay needs at least 1 agent and 2 engines (one of them freezes)")
        for name in ("storms_at", "update_at", "freeze_at", "restart_at"):
            value = getattr(self, name)
            for fraction in value if isinstance(value, tuple) else (value,):
                if not 0.0 <= fraction < 1.0:
                    raise ValueError(f"{name} must be fractions of the duration in [0, 1)")
        if not 0.0 <= self.long_share <= 1.0 or self.turns_per_session < 1:
            raise ValueError("long_share must be in [0, 1] and turns_per_session >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError("max_seq_len must be >= 1 (or None: no budget)")
        if self.update_on_failure not in (None, "keep", "exclude", "rollback"):
            raise ValueError(
                "update_on_failure must be keep, exclude, rollback or None (the gateway's default)"
            )
        if self.version_faults:
            faulty = {self.frozen_engine, self.failed_update_engine, self.restarted_engine}
            if len(faulty) < 3:
                raise ValueError(
                    "version_faults needs 3 different engines for the freeze, the failed update and the restart"
                )
            if not self.restart_at > self.update_at:
                raise ValueError("restart_at must come after update_at (a restart onto the old weights)")

    @property
    def frozen_engine(self) -> int:
        return self.freeze_engine % self.engines

    @property
    def failed_update_engine(self) -> int:
        return self.update_fail_engine % self.engines

    @property
    def restarted_engine(self) -> int:
        return self.restart_engine % self.engines

    def real_s(self, simulated_s: float) -> float:
        return simulated_s / self.time_scale

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplayConfig:
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScenarioEvent:
    """A scripted event: `storm` (new sessions arrive), `update` (weight update; with `version_faults` its
    `fail_engine`'s fails), `freeze` (an engine hangs), `restart` (an engine restarts onto its launch weights)."""

    kind: str
    at_s: float
    detail: dict[str, Any] = field(default_factory=dict)


def timeline(config: ReplayConfig) -> list[ScenarioEvent]:
    """The scripted events of a run, in time order."""
    d = config.duration_s
    events = [
        ScenarioEvent(kind="storm", at_s=f * d, detail={"sessions": config.storm_sessions, "wave": i})
        for i, f in enumerate(config.storms_at)
    ]
    update = {"fail_engine": config.failed_update_engine} if config.version_faults else {}
    events.append(ScenarioEvent(kind="update", at_s=config.update_at * d, detail=update))
    if config.version_faults:
        events.append(
            ScenarioEvent(
                kind="restart",
                at_s=config.restart_at * d,
                detail={
                    "engine": config.restarted_engine,
                    "down_s": config.restart_down_s,
                    "starting_s": config.restart_starting_s,
                },
            )
        )
    events.append(
        ScenarioEvent(kind="freeze", at_s=config.freeze_at * d, detail={"engine": config.frozen_engine})
    )
    return sorted(events, key=lambda e: e.at_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnPlan:
    kind: str  # "opening" | "medium" | "long" | "storm"
    max_tokens: int
    tool_time_s: float  # pause before the next turn
    tool_tokens: int | None = None  # the tool result appended after this turn (None: the config's)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionPlan:
    history_tokens: int
    turns: tuple[TurnPlan, ...]
    group: str | None = None  # a group's sessions share their prompt (the group's history) and its id


class AgentPlan:
    """An agent's endless, deterministic supply of sessions (the same in both modes)."""

    def __init__(
        self, config: ReplayConfig, agent: int, *, storm: bool = False, group: str | None = None
    ) -> None:
        self.config = config
        self.agent = agent
        self.group = group
        self.start_s = (
            0.0
            if storm
            else random.Random(f"{config.seed}/start/{agent}").uniform(0.0, config.start_spread_s)
        )
        self._storm = storm
        self._count = 0

    def next_session(self) -> SessionPlan:
        config = self.config
        rng = random.Random(f"{config.seed}/{'storm' if self._storm else 'agent'}/{self.agent}/{self._count}")
        self._count += 1
        history = rng.randint(*config.history_tokens)
        if self.group is not None:  # the group's one prompt
            history = random.Random(f"{config.seed}/group/{self.group}").randint(*config.history_tokens)
        if self._storm:
            return SessionPlan(
                history_tokens=history,
                turns=(
                    TurnPlan(kind="storm", max_tokens=rng.randint(*config.storm_tokens), tool_time_s=0.0),
                ),
                group=self.group,
            )
        turns = [TurnPlan(kind="opening", max_tokens=rng.randint(*config.opening_tokens), tool_time_s=0.0)]
        for _ in range(config.turns_per_session - 1):
            is_long = rng.random() < config.long_share
            span = config.long_tokens if is_long else config.medium_tokens
            turns.append(
                TurnPlan(
                    kind="long" if is_long else "medium",
                    max_tokens=rng.randint(*span),
                    tool_time_s=0.0,
                )
            )
        # the tool runs between turns: its time belongs to the turn before
        timed = [
            TurnPlan(kind=t.kind, max_tokens=t.max_tokens, tool_time_s=rng.uniform(*config.tool_time_s))
            for t in turns
        ]
        return SessionPlan(history_tokens=history, turns=tuple(timed))


def agent_plan(
    config: ReplayConfig, agent: int, *, storm: bool = False, group: str | None = None
) -> AgentPlan:
    return AgentPlan(config, agent, storm=storm, group=group)
