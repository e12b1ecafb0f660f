"""The exact world: the gateway's sans-IO core and the simulator's engine model in one process, virtual time.

Theory of operation
-------------------
No HTTP, no event loop, no real time: a discrete-event loop couples `core.gateway.Gateway` (events in, commands
out, deadlines) to one `sim.engine_model.EngineModel` per engine (the `incident` profile, the same physics the
HTTP simulator runs) and the incident replay's agents (bench/prefill/exact_agents.py: the same plans, storms and
seed as the HTTP replay, walked as bench/replay/agents.py walks them). Optionally the replay's weight update
too (`weight_update`); never its freeze.

What the edges would do, done here directly (server/driver.py, server/pool.py, server/app.py):
- engines join with the capacity the probe reports (`max_running_requests`) and the pool's prefill budget
  (`default_prefill_budget` from the chunk size, or none when the setting is 0); the core's settings come from
  `GatewaySettings` through the server's own `core_config`, with the replay's timeout and stall timeout;
- `Dispatch` submits the attempt to its engine as `<request id>-<attempt>`; `Abort` aborts it there;
- every stream event an engine would send (the first token, then every `progress_every_tokens`, then the end)
  becomes `ProgressReported` at the simulated time of that token, the end also `UpstreamFinished`;
- `Complete` answers the agent's call; `Fail` fails it (the agent tries again, as LiteLLM does). Clients never
  time out (in engine-time mode the gateway's keep-alives hold non-streaming calls open);
- the weight update is server/admin.py's, mode in_place: `GateClosed`, every engine paused in place, 25 s,
  caches flushed (`EngineCacheFlushed`), engines resumed, `GateOpened`.

Exactness. Engines interact only through the core, so the loop moves every engine to the next moment anything
the core could act on may happen, and no further: the core's next deadline, an agent's next call, a storm, or
an engine's next *critical* event: a step end while it has prefill work (a first token frees budget), or, while
it only decodes, its first request to finish (computed with the model's own step-cost formula, the arithmetic
of its decode bursts). Progress in between is told to the core afterwards with each token's exact time; it
changes no decision (the loop checks: a command out of the past raises). Same seed, same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rolloutgate.bench.prefill.exact_agents import ExactAgents
from rolloutgate.bench.prefill.measure import MODE_SETTINGS
from rolloutgate.bench.replay.scenario import ReplayConfig
from rolloutgate.config import GatewaySettings
from rolloutgate.core.admission import default_prefill_budget
from rolloutgate.core.commands import Abort, Command, Complete, Dispatch, Fail
from rolloutgate.core.events import (
    EngineCacheFlushed,
    EngineJoined,
    Event,
    GateClosed,
    GateOpened,
    PauseMode,
    ProgressReported,
    RequestArrived,
    RequestLimits,
    UpstreamFailed,
    UpstreamFinished,
)
from rolloutgate.core.gateway import Gateway
from rolloutgate.server.app import core_config
from rolloutgate.server.driver import upstream_id
from rolloutgate.sim.engine_model import EngineModel
from rolloutgate.sim.profiles import decode_step_s, make_config
from rolloutgate.sim.request import RequestState, SimRequest

__all__ = ("ExactRecords", "ExactWorld", "run_exact")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExactRecords:
    """One run (one seed, one mode): JSON-able dicts, simulated seconds throughout."""

    mode: str
    config: dict[str, Any]
    storms: list[dict[str, Any]]  # {"wave", "at", "sessions"}
    turns: list[dict[str, Any]]  # TurnRecord.to_json() + "request_ids" (the client's attempts, in order)
    generations: list[dict[str, Any]]  # one per engine attempt, with its token times
    contention_s: list[float]  # each ended gateway request's uncharged contention
    holds: list[dict[str, Any]]  # {"engine", "start_at", "end_at"}: an engine paused for the weight update
    prefill_budget: float
    ended_at: float


@dataclass(slots=True)
class _Attempt:
    """A dispatched attempt on an engine, and how much of it the core has been told."""

    request_id: str
    attempt: int
    engine: int
    req: SimRequest
    sent: int = 0
    aborted: bool = False  # the core let it go; the engine may still finish its step with it


class ExactWorld:
    """One run: `ExactWorld(config, mode).run()`. `config.prefill_admission` is ignored: `mode` decides."""

    def __init__(
        self,
        config: ReplayConfig,
        mode: str,
        *,
        progress_every_tokens: int = 64,
        weight_update: bool = False,
        step_by_step: bool = False,
    ) -> None:
        if mode not in MODE_SETTINGS:
            raise ValueError(f"mode must be one of {tuple(MODE_SETTINGS)}, got {mode!r}")
        self.config = config
        self.mode = mode
        self.progress_every = max(1, progress_every_tokens)
        self.step_by_step = step_by_step  # stop at every engine step (slow; the tests compare the two)
        settings = GatewaySettings(
            clock="engine",
            timeout=config.gateway_timeout_s,
            stall_timeout=config.stall_timeout_s,
            **MODE_SETTINGS[mode],
        )
        self.core = Gateway(core_config(settings))
        self.limits = RequestLimits(timeout_s=settings.timeout, stall_timeout_s=settings.stall_timeout)
        engine_config = make_config("incident", record_token_times=True)
        self.engine_config = engine_config
        self.engines = [EngineModel(engine_config, api="sglang") for _ in range(config.engines)]
        capacity = engine_config.max_running_requests
        configured = settings.prefill_budget_tokens  # as server/pool.py: None derived, 0 none
        self.prefill_budget = (
            float(default_prefill_budget(engine_config.chunked_prefill_size, capacity))
            if configured is None
            else (math.inf if configured == 0 else float(configured))
        )
        self.now = 0.0
        self._live: list[dict[str, _Attempt]] = [{} for _ in self.engines]  # per engine, by upstream rid
        self._generations: list[tuple[int, SimRequest]] = []
        self._contention: list[float] = []
        self._seq = 0
        # scripted events: (at, kind, argument), in time order
        script = [(f * config.duration_s, "storm", wave) for wave, f in enumerate(config.storms_at)]
        if weight_update:
            script.append((config.update_at * config.duration_s, "update", 0))
        self._script = sorted(script)
        self._holds: list[dict[str, Any]] = []
        self.agents = ExactAgents(config, self._arrive)
        for index in range(len(self.engines)):
            self._execute(
                self.core.handle(
                    EngineJoined(
                        engine_id=_engine_id(index),
                        capacity=capacity,
                        prefill_token_budget=self.prefill_budget,
                    ),
                    0.0,
                ),
                0.0,
            )

    # --- the loop -------------------------------------------------------------------------------------

    def run(self) -> ExactRecords:
        end = self.config.duration_s
        while True:
            horizon = min(self.core.next_deadline(), end, self.agents.next_wakeup_at())
            if self._script:
                horizon = min(horizon, self._script[0][0])
            horizon = self._engine_horizon(horizon)
            now = max(self.now, horizon)
            self.now = now
            self._advance_engines(now)
            if now >= self.core.next_deadline():
                self._execute(self.core.on_time(now), now)
            while self._script and self._script[0][0] <= now:
                self._scripted(*self._script.pop(0)[1:], now)
            self.agents.wake_due(now)
            if now >= end:
                break
        return self._records(end)

    def _engine_horizon(self, horizon: float) -> float:
        """The earliest critical moment of any engine before `horizon` (module docstring, exactness)."""
        decoding_only: list[int] = []
        for index, model in enumerate(self.engines):
            at = model.next_event_at()
            if at == math.inf:
                continue
            live = self._live[index]
            if (
                not self.step_by_step
                and live
                and all(
                    a.req.state is RequestState.RUNNING and a.req.abort_pending is None for a in live.values()
                )
            ):
                decoding_only.append(index)
            else:
                horizon = min(horizon, at)
        for index in decoding_only:
            horizon = min(horizon, self._first_finish_at(index, horizon))
        return horizon

    def _first_finish_at(self, index: int, horizon: float) -> float:
        """When the first of an engine's decodes ends (one token per decode step; the step costs as the model's
        decode bursts compute them), or a time past `horizon` if later."""
        requests = [a.req for a in self._live[index].values()]
        at = self.engines[index].next_event_at()
        steps = min(r.limit - r.completion_tokens for r in requests)
        batch = len(requests)
        context = sum(r.context_tokens for r in requests)
        config = self.engine_config
        step = 1
        while step < steps and at <= horizon:
            context += batch
            at += decode_step_s(config, batch, context)
            step += 1
        return at

    def _advance_engines(self, now: float) -> None:
        """Every engine to `now`; what the engines streamed goes to the core at its own times."""
        pending: list[tuple[float, int, Event]] = []
        for index, model in enumerate(self.engines):
            live = self._live[index]
            for req in model.advance(now):
                attempt = live.get(req.rid)
                if attempt is None:
                    continue
                if not attempt.aborted:
                    self._stream(attempt, pending)
                if req.is_finished:
                    del live[req.rid]
        pending.sort(key=lambda item: (item[0], item[1]))
        for at, _, event in pending:
            if at >= self.core.next_deadline():
                self._execute(self.core.on_time(at), at)
            self._execute(self.core.handle(event, at), at)

    def _stream(self, a: _Attempt, out: list[tuple[float, int, Event]]) -> None:
        """The stream events of `a` since the last call, as server/driver.py hands them to the core."""
        req = a.req
        count = req.completion_tokens
        times = req.token_times or []
        marks: list[int] = []
        position = a.sent
        if count > position:
            if position == 0:
                marks.append(1)
                position = 1
            following = (position // self.progress_every + 1) * self.progress_every
            while following <= count:
                marks.append(following)
                following += self.progress_every
        if req.is_finished and (not marks or marks[-1] != count) and count > a.sent:
            marks.append(count)
        for mark in marks:
            self._seq += 1
            event = ProgressReported(request_id=a.request_id, tokens=mark - a.sent, attempt=a.attempt)
            out.append((times[mark - 1], self._seq, event))
            a.sent = mark
        if req.is_finished:
            self._seq += 1
            assert req.finish is not None and req.finished_at is not None
            end: Event
            if req.finish.kind == "abort":
                end = UpstreamFailed(
                    request_id=a.request_id, reason=req.finish.message or "abort", attempt=a.attempt
                )
            else:
                end = UpstreamFinished(request_id=a.request_id, attempt=a.attempt)
            out.append((req.finished_at, self._seq, end))

    # --- commands -------------------------------------------------------------------------------------

    def _execute(self, commands: list[Command], at: float) -> None:
        if commands and at < self.now:
            # only progress is told after the fact, and progress never makes the core act
            raise RuntimeError(f"the core acted in the past ({at} < {self.now}): {commands[0]!r}")
        for command in commands:
            if isinstance(command, Dispatch):
                self._dispatch(command, at)
            elif isinstance(command, Abort):
                self._abort(command, at)
            elif isinstance(command, Complete):
                self._contention.append(command.timing.contention_s)
                self.agents.answered(command.request_id, at)
            elif isinstance(command, Fail):
                self._contention.append(command.timing.contention_s)
                self.agents.failed(command.request_id, at)

    def _arrive(self, request_id: str, routing_key: str, prompt_tokens: int, now: float) -> None:
        """An agent's call reaches the gateway (server/front.py: X-Session-Id as the routing key)."""
        arrived = RequestArrived(
            request_id=request_id, limits=self.limits, routing_key=routing_key, prompt_tokens=prompt_tokens
        )
        self._execute(self.core.handle(arrived, now), now)

    def _dispatch(self, command: Dispatch, at: float) -> None:
        call = self.agents.call(command.request_id)
        index = _engine_index(command.engine_id)
        rid = upstream_id(command.request_id, command.attempt)
        req = SimRequest(
            rid, call.prompt_ids, max_new_tokens=call.turn.max_tokens, seed=self.config.seed, ignore_eos=True
        )
        self.engines[index].submit(req, at)
        self._live[index][rid] = _Attempt(
            request_id=command.request_id, attempt=command.attempt, engine=index, req=req
        )
        self._generations.append((index, req))

    def _abort(self, command: Abort, at: float) -> None:
        index = _engine_index(command.engine_id)
        for rid, a in list(self._live[index].items()):
            if a.request_id == command.request_id and not a.aborted:
                a.aborted = True  # kept until it ends there: until then the engine is not decoding only
                self.engines[index].abort(rid, at)

    def _scripted(self, kind: str, argument: int, now: float) -> None:
        if kind == "storm":
            self.agents.storm(argument, now)
        elif kind == "update":
            self._update(now)
        else:
            self._update_done(now)

    def _update(self, now: float) -> None:
        """The replay's engine-time weight update (server/admin.py `update_weights`, mode in_place): the gate
        closes, every engine pauses in place, loads the weights (`weight_update_s`), flushes its cache where
        it can (SGLang refuses while requests are held), resumes, and the gate opens."""
        self._execute(self.core.handle(GateClosed(mode=PauseMode.IN_PLACE), now), now)
        for index, model in enumerate(self.engines):
            model.pause("in_place", now)
            self._holds.append({"engine": index, "start_at": now, "end_at": None})
        self._script.append((now + self.engine_config.weight_update_s, "update_done", 0))
        self._script.sort()

    def _update_done(self, now: float) -> None:
        for index, model in enumerate(self.engines):
            model.flush_cache(now)
            self._execute(self.core.handle(EngineCacheFlushed(engine_id=_engine_id(index)), now), now)
        for model, hold in zip(self.engines, self._holds[-len(self.engines) :], strict=True):
            model.resume(now)
            hold["end_at"] = now
        self._execute(self.core.handle(GateOpened(), now), now)

    # --- records --------------------------------------------------------------------------------------

    def _records(self, end: float) -> ExactRecords:
        generations = [
            {
                "engine": index,
                "rid": req.rid,
                "prompt_tokens": req.prompt_tokens,
                "cached_tokens": req.cached_tokens,
                "completion_tokens": req.completion_tokens,
                "submitted_at": req.submitted_at,
                "started_at": req.started_at,  # admitted: its cached tokens are known from then on
                "first_token_at": req.first_token_at,
                "finished_at": req.finished_at,
                "finish": None if req.finish is None else req.finish.kind,
                "token_times": list(req.token_times or ()),
            }
            for index, req in self._generations
        ]
        return ExactRecords(
            mode=self.mode,
            config=self.config.to_json(),
            storms=self.agents.storms,
            holds=self._holds,
            turns=self.agents.turn_records(),
            generations=generations,
            contention_s=self._contention,
            prefill_budget=self.prefill_budget,
            ended_at=end,
        )


def _engine_id(index: int) -> str:
    return f"engine-{index}"


def _engine_index(engine_id: str) -> int:
    return int(engine_id.rpartition("-")[2])


def run_exact(
    config: ReplayConfig, mode: str, *, progress_every_tokens: int = 64, weight_update: bool = False
) -> ExactRecords:
    """One run of `config` (its seed) with admission `mode` ("off" or "on"), with or without the weight
    update."""
    return ExactWorld(
        config, mode, progress_every_tokens=progress_every_tokens, weight_update=weight_update
    ).run()
