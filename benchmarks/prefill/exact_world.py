"""The exact world: the incident replay's load on the gateway's sans-IO core and the simulator's engine model, in
one process, virtual time.

Theory of operation
-------------------
The virtual-time world (benchmarks/kit/world.py: the core, one `EngineModel` per engine of the `incident`
profile, the loop and its exactness) runs the incident replay's agents (benchmarks/prefill/exact_agents.py: the
same plans, storms and seed as the HTTP replay, walked as rolloutreplay/agents.py walks them). Optionally the replay's
weight update too (`weight_update`); never its freeze.

What this module adds to the world:
- the core's settings: `GatewaySettings` of the mode (MODE_SETTINGS: prefill-aware admission off or on) with
  the replay's timeout and stall timeout, or the caller's own (`settings`, for another placement);
- an agent's call reaches the gateway as the front would send it (server/front.py: X-Session-Id as the
  routing key, the replay's limits); clients never time out (in engine-time mode the gateway's keep-alives hold
  non-streaming calls open);
- the storms, at the replay's fractions of the run;
- the weight update, server/admin.py's, mode in_place: `GateClosed`, every engine paused in place, 25 s,
  caches flushed (`EngineCacheFlushed`), engines resumed, `GateOpened`;
- the records, as the HTTP replay's measurement reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks.kit.world import VirtualWorld, engine_id
from benchmarks.prefill.exact_agents import ExactAgents
from benchmarks.prefill.measure import MODE_SETTINGS
from rolloutgate.config import GatewaySettings
from rolloutgate.core.events import (
    EngineCacheFlushed,
    GateClosed,
    GateOpened,
    PauseMode,
    RequestArrived,
    RequestLimits,
)
from rolloutreplay.scenario import ReplayConfig
from rolloutsim.profiles import make_config

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


class ExactWorld:
    """One run: `ExactWorld(config, mode).run()`. `config.prefill_admission` is ignored: `mode` decides, or
    `settings` (the mode's, with another placement) when given."""

    def __init__(
        self,
        config: ReplayConfig,
        mode: str,
        *,
        progress_every_tokens: int = 64,
        weight_update: bool = False,
        step_by_step: bool = False,
        settings: GatewaySettings | None = None,
    ) -> None:
        if mode not in MODE_SETTINGS:
            raise ValueError(f"mode must be one of {tuple(MODE_SETTINGS)}, got {mode!r}")
        self.config = config
        self.mode = mode
        if settings is None:
            settings = GatewaySettings(
                clock="engine",
                timeout=config.gateway_timeout_s,
                stall_timeout=config.stall_timeout_s,
                **MODE_SETTINGS[mode],
            )
        self.limits = RequestLimits(timeout_s=settings.timeout, stall_timeout_s=settings.stall_timeout)
        self.world = VirtualWorld(
            settings,
            make_config("incident", record_token_times=True),
            engines=config.engines,
            seed=config.seed,
            progress_every_tokens=progress_every_tokens,
            step_by_step=step_by_step,
        )
        self.engine_config = self.world.engine_config
        self.prefill_budget = self.world.prefill_budget
        self._holds: list[dict[str, Any]] = []
        self.agents = ExactAgents(config, self._arrive)
        for wave, fraction in enumerate(config.storms_at):
            self.world.schedule(fraction * config.duration_s, partial(self.agents.storm, wave))
        if weight_update:
            self.world.schedule(config.update_at * config.duration_s, self._update)

    def run(self) -> ExactRecords:
        end = self.config.duration_s
        self.world.run(self.agents, end)
        return self._records(end)

    def _arrive(self, request_id: str, routing_key: str, prompt_tokens: int, now: float) -> None:
        """An agent's call reaches the gateway (server/front.py: X-Session-Id as the routing key)."""
        arrived = RequestArrived(
            request_id=request_id, limits=self.limits, routing_key=routing_key, prompt_tokens=prompt_tokens
        )
        self.world.arrive(arrived, now)

    def _update(self, now: float) -> None:
        """The replay's engine-time weight update (server/admin.py `update_weights`, mode in_place): the gate
        closes, every engine pauses in place, loads the weights (`weight_update_s`), flushes its cache where
        it can (SGLang refuses while requests are held), resumes, and the gate opens."""
        world = self.world
        world.execute(world.core.handle(GateClosed(mode=PauseMode.IN_PLACE), now), now)
        for index, model in enumerate(world.engines):
            model.pause("in_place", now)
            self._holds.append({"engine": index, "start_at": now, "end_at": None})
        world.schedule(now + self.engine_config.weight_update_s, self._update_done)

    def _update_done(self, now: float) -> None:
        world = self.world
        for index, model in enumerate(world.engines):
            model.flush_cache(now)
            world.execute(world.core.handle(EngineCacheFlushed(engine_id=engine_id(index)), now), now)
        for model, hold in zip(world.engines, self._holds[-len(world.engines) :], strict=True):
            model.resume(now)
            hold["end_at"] = now
        world.execute(world.core.handle(GateOpened(), now), now)

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
            for index, req in self.world.generations
        ]
        return ExactRecords(
            mode=self.mode,
            config=self.config.to_json(),
            storms=self.agents.storms,
            holds=self._holds,
            turns=self.agents.turn_records(),
            generations=generations,
            contention_s=self.world.contention_s,
            prefill_budget=self.prefill_budget,
            ended_at=end,
        )


def run_exact(
    config: ReplayConfig, mode: str, *, progress_every_tokens: int = 64, weight_update: bool = False
) -> ExactRecords:
    """One run of `config` (its seed) with admission `mode` ("off" or "on"), with or without the weight
    update."""
    return ExactWorld(
        config, mode, progress_every_tokens=progress_every_tokens, weight_update=weight_update
    ).run()
