"""The incident replay's agents in virtual time, for the exact world (benchmarks/prefill/exact_world.py): the
workload of the virtual-time world (benchmarks/kit/world.py).

Theory of operation: each agent follows its `AgentPlan` (rolloutreplay/scenario.py, the same plans as the HTTP
replay for a seed) the way rolloutreplay/agents.py walks it, with no event loop: a session opens with its
history (unique token ids: no session shares a prefix with another) and a short task message; each turn is one
call with the session's whole history as its prompt and the turn's `max_tokens` (`ignore_eos`: every answer has
its planned length); when it is answered, the answer's first `reply_kept_tokens` (~1K; all of a shorter
answer, counted in tokens where the HTTP replay counts 4 bytes a token) and a ~1K-token tool result join the
history, the tool's time passes, and the next turn starts (after the last, the next session). A failed call is
made again, up to `CLIENT_ATTEMPTS` calls in all (LiteLLM's retries); then the turn fails and ends its session
(a failed sample), and the agent starts a new one at once. A storm's agents run one single-turn session each.

The world tells the agents what the gateway answered (`answered`, `failed`) and when time has come
(`wake_due`); the agents make calls through `arrive(request_id, routing_key, prompt_tokens, now)`, the
world's intake, with one gateway request id per call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rolloutreplay.agents import TurnRecord
from rolloutreplay.scenario import AgentPlan, ReplayConfig, SessionPlan, agent_plan

__all__ = ("CLIENT_ATTEMPTS", "Call", "ExactAgents")

CLIENT_ATTEMPTS = 3  # LiteLLM's default: the call and two retries
_TASK_TOKENS = 16  # the user message that opens a session ("Task of session ...")

Arrive = Callable[[str, str, int, float], None]


@dataclass(slots=True)
class _Agent:
    name: str
    plan: AgentPlan
    sessions_left: int | None  # None: sessions until the run ends
    count: int = 0
    session: SessionPlan | None = None
    session_name: str = ""
    turn: int = 0
    prompt_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Call:
    """A turn's call in flight: the gateway request of one client attempt."""

    agent: _Agent
    turn: TurnRecord
    prompt_ids: list[int]
    client_attempt: int


class ExactAgents:
    """The agents of one run: the config's agents from their start times, and the storms' agents."""

    def __init__(self, config: ReplayConfig, arrive: Arrive) -> None:
        self.config = config
        self._arrive = arrive
        self.turns: list[TurnRecord] = []
        self.request_ids: dict[str, list[str]] = {}  # turn tag -> the client's gateway request ids, in order
        self.storms: list[dict[str, Any]] = []  # {"wave", "at", "sessions"}
        self._calls: dict[str, Call] = {}
        self._wakeups: list[tuple[float, int, _Agent]] = []
        self._seq = 0
        self._next_request = 0
        self._next_token = 10_000_000
        for index in range(config.agents):
            agent = _Agent(f"a{index:02d}", agent_plan(config, index), None)
            self._schedule(agent, agent.plan.start_s)

    def next_wakeup_at(self) -> float:
        return self._wakeups[0][0] if self._wakeups else float("inf")

    def wake_due(self, now: float) -> None:
        """Every agent whose time has come by `now` makes its next call."""
        while self._wakeups and self._wakeups[0][0] <= now:
            self._wake(heapq.heappop(self._wakeups)[2], now)

    def storm(self, wave: int, now: float) -> None:
        sessions = self.config.storm_sessions
        self.storms.append({"wave": wave, "at": now, "sessions": sessions})
        for index in range(sessions):
            plan = agent_plan(self.config, wave * 1000 + index, storm=True)
            self._wake(_Agent(f"storm{wave}-{index}", plan, 1), now)

    def call(self, request_id: str) -> Call:
        """The call a gateway request carries (its prompt and length)."""
        return self._calls[request_id]

    def prompt(self, request_id: str) -> tuple[list[int], int]:
        """The prompt ids and length of the call a gateway request carries (the world's `Workload`)."""
        call = self._calls[request_id]
        return call.prompt_ids, call.turn.max_tokens

    def answered(self, request_id: str, now: float) -> None:
        call = self._calls.pop(request_id)
        agent, turn = call.agent, call.turn
        turn.ended_at, turn.ok = now, True
        turn.completion_tokens = turn.max_tokens
        assert agent.session is not None
        plan = agent.session.turns[agent.turn]
        kept = min(self.config.reply_kept_tokens, turn.max_tokens)
        agent.prompt_ids = agent.prompt_ids + self._new_tokens(kept + self.config.tool_tokens)
        agent.turn += 1
        self._schedule(agent, now + plan.tool_time_s)

    def failed(self, request_id: str, now: float) -> None:
        call = self._calls.pop(request_id)
        if call.client_attempt < CLIENT_ATTEMPTS:
            self._make(replace(call, client_attempt=call.client_attempt + 1), now)
            return
        call.turn.ended_at, call.turn.ok, call.turn.error = now, False, "GatewayError"
        agent = call.agent
        assert agent.session is not None
        agent.turn = len(agent.session.turns)  # a failed turn ends the session (a failed sample)
        self._schedule(agent, now)

    def turn_records(self) -> list[dict[str, Any]]:
        return [asdict(t) | {"request_ids": self.request_ids[t.tag]} for t in self.turns]

    def _schedule(self, agent: _Agent, at: float) -> None:
        self._seq += 1
        heapq.heappush(self._wakeups, (at, self._seq, agent))

    def _wake(self, agent: _Agent, now: float) -> None:
        """The agent's next turn, or its next session when the last one is over."""
        session = agent.session
        if session is None or agent.turn >= len(session.turns):
            if agent.sessions_left is not None and agent.count >= agent.sessions_left:
                return
            session = agent.session = agent.plan.next_session()
            agent.session_name = f"{agent.name}-s{agent.count}"
            agent.count += 1
            agent.turn = 0
            agent.prompt_ids = self._new_tokens(session.history_tokens + _TASK_TOKENS)
        plan = session.turns[agent.turn]
        turn = TurnRecord(
            tag=f"{agent.session_name}-t{agent.turn}",
            agent=agent.name,
            session=agent.session_name,
            turn=agent.turn,
            kind=plan.kind,
            max_tokens=plan.max_tokens,
            prompt_tokens=len(agent.prompt_ids),
            started_at=now,
        )
        self.turns.append(turn)
        self.request_ids[turn.tag] = []
        self._make(Call(agent=agent, turn=turn, prompt_ids=agent.prompt_ids, client_attempt=1), now)

    def _make(self, call: Call, now: float) -> None:
        self._next_request += 1
        request_id = f"r{self._next_request:07d}"
        self._calls[request_id] = call
        self.request_ids[call.turn.tag].append(request_id)
        self._arrive(request_id, call.agent.session_name, len(call.prompt_ids), now)

    def _new_tokens(self, count: int) -> list[int]:
        start = self._next_token
        self._next_token += count
        return list(range(start, start + count))
