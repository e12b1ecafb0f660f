"""The virtual-time world: the gateway's sans-IO core and the simulator's engine model in one process.

Theory of operation
-------------------
No HTTP, no event loop, no real time: a discrete-event loop couples `core.gateway.Gateway` (events in, commands
out, deadlines) to one `sim.engine_model.EngineModel` per engine (the same physics the HTTP simulator runs) and
to a workload (the incident replay's agents, a GRPO step's samples) that makes calls when its time comes.

What the edges would do, done here directly (server/driver.py, server/pool.py, server/app.py):
- engines join with the capacity their profile reports (`max_running_requests`) and the pool's prefill budget
  (`default_prefill_budget` from the chunk size, or none when the setting is 0); the core's settings come from
  `GatewaySettings` through the server's own `core_config`;
- `Dispatch` submits the attempt to its engine as `<request id>-<attempt>` (server/driver.py `upstream_id`);
  `Abort` aborts it there;
- every stream event an engine would send (the first token, then every `progress_every_tokens`, then the end)
  becomes `ProgressReported` at the simulated time of that token, the end also `UpstreamFinished` (or
  `UpstreamFailed` for an aborted generation);
- `Complete` answers the workload's call, `Fail` fails it; every other command goes to `observe`.

Exactness. Engines interact only through the core, so the loop moves every engine to the next moment anything
the core could act on may happen, and no further: the core's next deadline, the workload's next wake-up, a
scheduled action, or an engine's next *critical* event: a step end while it has prefill work (a first token
frees budget), or, while it only decodes, its first request to finish (computed with the model's own step-cost
formula, the arithmetic of its decode bursts). Progress in between is told to the core afterwards with each
token's exact time; it changes no decision (the loop checks: a command out of the past raises). With
`step_by_step` the loop stops at every engine step instead (slower; the tests compare the two). Same seed, same
numbers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rolloutgate.config import GatewaySettings
from rolloutgate.core.admission import default_prefill_budget
from rolloutgate.core.commands import Abort, Command, Complete, Dispatch, Fail
from rolloutgate.core.events import EngineJoined, Event, ProgressReported, UpstreamFailed, UpstreamFinished
from rolloutgate.core.gateway import Gateway
from rolloutgate.server.app import core_config
from rolloutgate.server.driver import upstream_id
from rolloutsim.engine_model import EngineModel
from rolloutsim.profiles import SimEngineConfig, decode_step_s
from rolloutsim.request import RequestState, SimRequest

__all__ = ("VirtualWorld", "Workload", "engine_id", "engine_index")


class Workload(Protocol):
    """What makes the calls: it arrives them through `VirtualWorld.arrive` when the world wakes it."""

    def next_wakeup_at(self) -> float:
        """When the workload next has something to do (`inf`: nothing more)."""
        ...

    def wake_due(self, now: float) -> None:
        """Do everything due by `now` (calls arrive through the world)."""
        ...

    def prompt(self, request_id: str) -> tuple[list[int], int]:
        """The prompt ids and `max_new_tokens` of the call a gateway request carries."""
        ...

    def answered(self, request_id: str, at: float) -> None: ...

    def failed(self, request_id: str, at: float) -> None: ...


@dataclass(slots=True)
class _Attempt:
    """A dispatched attempt on an engine, and how much of it the core has been told."""

    request_id: str
    attempt: int
    req: SimRequest
    sent: int = 0
    aborted: bool = False  # the core let it go; the engine may still finish its step with it


class VirtualWorld:
    """The core, `engines` engine models of `engine_config` (which must record token times) and a workload.

    `run(workload, end)` drives them to `end` (simulated seconds; `inf`: until nothing is left to happen).
    Raises ValueError for an engine config that does not record its token times, RuntimeError when the core
    acts in the past (module docstring, exactness)."""

    def __init__(
        self,
        settings: GatewaySettings,
        engine_config: SimEngineConfig,
        *,
        engines: int,
        seed: int,
        progress_every_tokens: int = 64,
        step_by_step: bool = False,
        observe: Callable[[Command, float], None] | None = None,
    ) -> None:
        if not engine_config.record_token_times:
            raise ValueError("the virtual world tells the core each token's time: record_token_times=True")
        self.core = Gateway(core_config(settings))
        self.engine_config = engine_config
        self.engines = [EngineModel(engine_config, api="sglang") for _ in range(engines)]
        self.seed = seed
        self.progress_every = max(1, progress_every_tokens)
        self.step_by_step = step_by_step
        self._observe = observe
        capacity = engine_config.max_running_requests
        configured = settings.prefill_budget_tokens  # as server/pool.py: None derived, 0 none
        self.prefill_budget = (
            float(default_prefill_budget(engine_config.chunked_prefill_size, capacity))
            if configured is None
            else (math.inf if configured == 0 else float(configured))
        )
        self.now = 0.0
        self.generations: list[tuple[int, SimRequest]] = []  # every attempt submitted, with its engine
        self.contention_s: list[float] = []  # each ended gateway request's uncharged contention
        self._workload: Workload | None = None
        self._live: list[dict[str, _Attempt]] = [{} for _ in self.engines]  # per engine, by upstream rid
        self._seq = 0
        self._scheduled: list[tuple[float, int, Callable[[float], None]]] = []
        for index in range(engines):
            joined = EngineJoined(
                engine_id=engine_id(index), capacity=capacity, prefill_token_budget=self.prefill_budget
            )
            self.execute(self.core.handle(joined, 0.0), 0.0)

    # --- the loop -------------------------------------------------------------------------------------

    def run(self, workload: Workload, end: float = math.inf) -> None:
        self._workload = workload
        while True:
            horizon = min(self.core.next_deadline(), end, workload.next_wakeup_at())
            if self._scheduled:
                horizon = min(horizon, self._scheduled[0][0])
            horizon = self._engine_horizon(horizon)
            if horizon == math.inf:
                break
            now = self.now = max(self.now, horizon)
            self._advance_engines(now)
            if now >= self.core.next_deadline():
                self.execute(self.core.on_time(now), now)
            while self._scheduled and self._scheduled[0][0] <= now:
                heapq.heappop(self._scheduled)[2](now)
            workload.wake_due(now)
            if now >= end:
                break

    def schedule(self, at: float, action: Callable[[float], None]) -> None:
        """Run `action(now)` at `at` (actions due at the same time run in the order they were scheduled)."""
        self._seq += 1
        heapq.heappush(self._scheduled, (at, self._seq, action))

    def arrive(self, event: Event, now: float) -> None:
        """A call reaches the gateway (or any event the workload sends the core)."""
        self.execute(self.core.handle(event, now), now)

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
        step = 1
        while step < steps and at <= horizon:
            context += batch
            at += decode_step_s(self.engine_config, batch, context)
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
                self.execute(self.core.on_time(at), at)
            self.execute(self.core.handle(event, at), at)

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

    def execute(self, commands: list[Command], at: float) -> None:
        """Carry out the core's commands at `at` (what the edges would do, module docstring)."""
        if commands and at < self.now:
            # only progress is told after the fact, and progress never makes the core act
            raise RuntimeError(f"the core acted in the past ({at} < {self.now}): {commands[0]!r}")
        for command in commands:
            if isinstance(command, Dispatch):
                self._dispatch(command, at)
            elif isinstance(command, Abort):
                self._abort(command, at)
            elif isinstance(command, Complete | Fail):
                self.contention_s.append(command.timing.contention_s)
                assert self._workload is not None, "a call ended before the world ran"
                if isinstance(command, Complete):
                    self._workload.answered(command.request_id, at)
                else:
                    self._workload.failed(command.request_id, at)
            elif self._observe is not None:
                self._observe(command, at)

    def _dispatch(self, command: Dispatch, at: float) -> None:
        assert self._workload is not None, "a dispatch before the world ran"
        prompt_ids, max_new_tokens = self._workload.prompt(command.request_id)
        index = engine_index(command.engine_id)
        rid = upstream_id(command.request_id, command.attempt)
        req = SimRequest(rid, prompt_ids, max_new_tokens=max_new_tokens, seed=self.seed, ignore_eos=True)
        self.engines[index].submit(req, at)
        self._live[index][rid] = _Attempt(request_id=command.request_id, attempt=command.attempt, req=req)
        self.generations.append((index, req))

    def _abort(self, command: Abort, at: float) -> None:
        index = engine_index(command.engine_id)
        for rid, a in list(self._live[index].items()):
            if a.request_id == command.request_id and not a.aborted:
                a.aborted = True  # kept until it ends there: until then the engine is not decoding only
                self.engines[index].abort(rid, at)


def engine_id(index: int) -> str:
    return f"engine-{index}"


def engine_index(engine_id: str) -> int:
    return int(engine_id.rpartition("-")[2])
