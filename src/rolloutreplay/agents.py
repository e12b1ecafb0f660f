"""The agents: multi-turn sessions driven through the gateway with the real LiteLLM client.

Theory of operation: an agent follows its `AgentPlan` (scenario.py): a session starts with a ~100K-token
history, each turn asks for `max_tokens` (with `ignore_eos`, so every turn has its planned length), and the
session's history grows by an excerpt of each answer and a tool result. A turn whose call fails (after
LiteLLM's own retries) ends the session, as a failed sample ends a rollout, and the agent starts a new one.

The call is `litellm.acompletion` with the incident's settings: non-streaming, `timeout` = the client timeout
in real seconds (300 simulated seconds / time scale), and LiteLLM's default retries (3 attempts), with
`ignore_eos` in the body (SGLang and the simulator honour it). The gateway sends the call on as it came,
non-streamed, and watches its engine's load for progress (core/engine_watch.py).

Each call runs within `attempts.recording` with its turn's tag: the HTTP attempts LiteLLM makes of it land in
the fleet's `attempts` (attempts.py), joined later to the gateway's requests and the engines' generations.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from rolloutgate.server.front import GROUP_HEADER
from rolloutreplay.attempts import AttemptRecord, install, recording
from rolloutreplay.scenario import AgentPlan, ReplayConfig, SessionPlan

__all__ = ("AgentFleet", "TurnRecord", "import_litellm")

_FILLER = "lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 64  # 3,648 bytes


def import_litellm() -> Any:
    """LiteLLM, imported once per process, offline (it would fetch a price map from the internet), its HTTP
    attempts recorded (attempts.py)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import litellm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "the replay drives its agents with LiteLLM: pip install litellm (or `make venv`)"
        ) from exc
    litellm.suppress_debug_info = True
    litellm.telemetry = False
    install(litellm)
    return litellm


def text_of_tokens(prefix: str, tokens: int) -> str:
    """Text the simulator reads as about `tokens` tokens (4 bytes each); `prefix` makes it unique (no shared
    prefix with any other session, so nothing of it is in any engine's cache)."""
    size = max(4, tokens * 4)
    head = f"[{prefix}] "
    body_size = size - len(head)
    repeats = body_size // len(_FILLER) + 1
    return head + (_FILLER * repeats)[:body_size]


@dataclass(slots=True)
class TurnRecord:
    """One turn from the agent's side (one LiteLLM call, its retries included)."""

    tag: str
    agent: str
    session: str
    turn: int
    kind: str
    max_tokens: int
    prompt_tokens: int  # approximate (4 bytes per token)
    started_at: float
    ended_at: float | None = None
    ok: bool | None = None  # None: still running when the run ended
    error: str | None = None  # exception class name
    message: str | None = None
    completion_tokens: int = 0
    budget_full: bool = False  # refused: its prompt filled its session's token budget (ends the session)


class AgentFleet:
    """Runs agents against one gateway URL until `stop()`; every turn lands in `turns`, every HTTP attempt of
    one in `attempts`."""

    def __init__(
        self,
        config: ReplayConfig,
        gateway_url: str,
        now: Callable[[], float],
        litellm: Any,
        http: aiohttp.ClientSession,
    ) -> None:
        self.config = config
        self.gateway_url = gateway_url
        self.now = now
        self.litellm = litellm
        self.http = http
        self.turns: list[TurnRecord] = []
        self.attempts: list[AttemptRecord] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    def start_agent(self, plan: AgentPlan, name: str, *, sessions: int | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._run(plan, name, sessions), name=f"agent-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Cancel every agent; turns still running stay recorded with `ok=None`."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, plan: AgentPlan, name: str, sessions: int | None) -> None:
        await self._sleep_until(plan.start_s)
        count = 0
        while not self._stopping and (sessions is None or count < sessions):
            await self._session(plan.next_session(), name, count)
            count += 1

    async def _sleep_until(self, at_s: float) -> None:
        delay = self.config.real_s(at_s - self.now())
        if delay > 0:
            await asyncio.sleep(delay)

    async def _base_url(self, session_name: str) -> tuple[str, dict[str, str], str]:
        """Where the session's calls go, their headers, and their routing key at the gateway."""
        budget = self.config.max_seq_len
        if not self.config.sessions:
            headers = {"X-Session-Id": session_name}
            if budget is not None:
                headers["X-Rolloutgate-Max-Seq-Len"] = str(budget)
            return f"{self.gateway_url}/v1", headers, session_name
        body = {} if budget is None else {"max_seq_len": budget}
        async with self.http.post(f"{self.gateway_url}/sessions", json=body) as response:
            response.raise_for_status()
            session_id = (await response.json())["session_id"]
        return f"{self.gateway_url}/sessions/{session_id}/v1", {}, session_id

    async def _session(self, plan: SessionPlan, agent: str, index: int) -> None:
        session = f"{agent}-s{index}"
        base_url, headers, routing_key = await self._base_url(session)
        prompt = session if plan.group is None else plan.group  # a group's samples share one prompt
        if plan.group is not None:
            headers = {**headers, GROUP_HEADER: plan.group}
        history = text_of_tokens(prompt, plan.history_tokens)
        messages: list[dict[str, str]] = [
            {"role": "system", "content": history},
            {"role": "user", "content": f"Task of session {prompt}: work through it step by step."},
        ]
        prompt_tokens = plan.history_tokens
        for number, turn in enumerate(plan.turns):
            record = TurnRecord(
                tag=f"{session}-t{number}",
                agent=agent,
                session=session,
                turn=number,
                kind=turn.kind,
                max_tokens=turn.max_tokens,
                prompt_tokens=prompt_tokens,
                started_at=self.now(),
            )
            self.turns.append(record)
            with recording(record.tag, routing_key, self.now, self.attempts):
                answer = await self._call(record, base_url, headers, messages)
            if answer is None:
                return  # a failed turn ends the session (a failed sample)
            kept = answer[: self.config.reply_kept_tokens * 4]
            tool_tokens = self.config.tool_tokens if turn.tool_tokens is None else turn.tool_tokens
            tool = text_of_tokens(f"{record.tag} tool", tool_tokens)
            messages = [*messages, {"role": "assistant", "content": kept}, {"role": "user", "content": tool}]
            prompt_tokens += (len(kept) + len(tool)) // 4
            await asyncio.sleep(self.config.real_s(turn.tool_time_s))

    async def _call(
        self, record: TurnRecord, base_url: str, headers: dict[str, str], messages: list[dict[str, str]]
    ) -> str | None:
        config = self.config
        try:
            response = await self.litellm.acompletion(
                model="openai/sim-model",
                api_base=base_url,
                api_key="replay",
                messages=messages,
                max_tokens=record.max_tokens,
                timeout=config.real_s(config.client_timeout_s),
                # `user`, OpenAI's end-user field, in the body (LiteLLM drops its own `user=` for this
                # provider): a trace replays one user's sessions one after another (trace_workload.py)
                extra_body={"ignore_eos": True, "user": record.agent},
                extra_headers=headers,
            )
        except asyncio.CancelledError:
            record.ended_at = self.now()
            raise
        except Exception as exc:  # LiteLLM maps every failure to its own exception classes
            record.ended_at = self.now()
            record.ok = False
            record.error = type(exc).__name__
            record.message = str(exc)[:300]
            # the gateway's 400 context_length_exceeded: the session has spent its token budget
            record.budget_full = config.max_seq_len is not None and isinstance(
                exc, self.litellm.ContextWindowExceededError
            )
            return None
        record.ended_at = self.now()
        record.ok = True
        usage = getattr(response, "usage", None)
        record.completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
        return str(response.choices[0].message.content or "")
