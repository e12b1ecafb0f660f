"""A GRPO-shaped workload on the gateway's core and the simulator's engine model, in virtual time.

Theory of operation
-------------------
The shape of a GRPO rollout step: `groups` prompts of `prompt_tokens` each (distinct token ids per prompt),
`n` samples of each prompt sent together, the groups arriving `arrival_gap_s` apart, every sample decoding
its own length (seeded, uniform in [min_new_tokens, max_new_tokens]). The same workload runs twice, same seed,
same placement (the production default, prefill-aware): once with each sample's group id
(`RequestArrived.group`, what the front reads from `X-Rolloutgate-Group` or the body's `rolloutgate_group`),
once without.

No HTTP and no real time: a discrete-event loop couples `core.gateway.Gateway` to one
`sim.engine_model.EngineModel` per engine (the `incident` profile: SGLang-like prefill before decode, a
prefix cache matched when a request is admitted, 4,600 prefill tokens/s), as bench/prefill/exact_world.py
does for the incident replay, stopping at every engine step. A dispatched sample is submitted to its engine
at once; its first token, then every `progress_every` tokens, then its end are told to the core at the time
the engine produced them.

Figures per run (simulated seconds):
- prefill tokens: prompt tokens the engines computed (not served from their prefix caches), the engines' own
  count; and the prefix-cache hit rate (cached / prompt tokens);
- the core's estimate of the prefill its group placement saved (`RecordGroup.prefill_tokens_saved`);
- group completion time (first sample's arrival to its slowest sample's end): p50, p90, p99, max; the core's
  `RecordGroup.completion_s` where groups are on, the same arithmetic from the samples' ends where not;
- the makespan (the last sample's end).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from rolloutgate.config import GatewaySettings
from rolloutgate.core.admission import default_prefill_budget
from rolloutgate.core.commands import Command, Complete, Dispatch, Fail, RecordGroup
from rolloutgate.core.events import EngineJoined, ProgressReported, RequestArrived, UpstreamFinished
from rolloutgate.core.gateway import Gateway
from rolloutgate.server.app import core_config
from rolloutgate.server.driver import upstream_id
from rolloutgate.sim.engine_model import EngineModel
from rolloutgate.sim.profiles import make_config
from rolloutgate.sim.request import SimRequest

__all__ = ("GrpoConfig", "GrpoRun", "percentile", "run_grpo")


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpoConfig:
    engines: int = 4
    groups: int = 32
    n: int = 8  # samples per prompt
    prompt_tokens: int = 20_000
    min_new_tokens: int = 256
    max_new_tokens: int = 1024
    arrival_gap_s: float = 1.0  # between two groups' arrivals
    progress_every: int = 64  # tokens per progress report to the core
    seed: int = 0
    placement: str = "prefill_aware"

    def __post_init__(self) -> None:
        if min(self.engines, self.groups, self.n, self.prompt_tokens, self.progress_every) < 1:
            raise ValueError("engines, groups, n, prompt_tokens and progress_every must be >= 1")
        if not 0 < self.min_new_tokens <= self.max_new_tokens:
            raise ValueError("need 0 < min_new_tokens <= max_new_tokens")
        if not 0 <= self.arrival_gap_s < math.inf:
            raise ValueError("arrival_gap_s must be a finite duration >= 0")


@dataclass(slots=True, kw_only=True)
class GrpoRun:
    """One run's figures (see the module docstring)."""

    grouped: bool
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # computed by the engines
    estimated_saved_tokens: int = 0  # the core's RecordGroup sum
    group_completion_s: list[float] = field(default_factory=list)
    groups_finished: int = 0
    failed_samples: int = 0
    makespan_s: float = 0.0
    per_engine_samples: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        times = sorted(self.group_completion_s)
        return {
            "grouped": self.grouped,
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 4),
            "estimated_saved_tokens": self.estimated_saved_tokens,
            "groups": len(times),
            "groups_finished": self.groups_finished,
            "failed_samples": self.failed_samples,
            "group_completion_s": {
                "p50": percentile(times, 50),
                "p90": percentile(times, 90),
                "p99": percentile(times, 99),
                "max": times[-1] if times else math.nan,
            },
            "makespan_s": self.makespan_s,
            "per_engine_samples": self.per_engine_samples,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of already sorted values; NaN for none."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


@dataclass(slots=True)
class _Sample:
    request_id: str
    group: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrive_at: float
    attempt: int = 0
    engine: int = -1
    req: SimRequest | None = None
    sent: int = 0
    ended_at: float | None = None
    failed: bool = False


class _World:
    def __init__(self, config: GrpoConfig, *, grouped: bool) -> None:
        self.config = config
        self.grouped = grouped
        settings = GatewaySettings(clock="engine", placement=config.placement)  # type: ignore[arg-type]
        self.core = Gateway(core_config(settings))
        engine_config = make_config("incident")
        self.models = [EngineModel(engine_config, api="sglang") for _ in range(config.engines)]
        capacity = engine_config.max_running_requests
        budget = float(default_prefill_budget(engine_config.chunked_prefill_size, capacity))
        self.run = GrpoRun(grouped=grouped, per_engine_samples=[0] * config.engines)
        self.samples: dict[str, _Sample] = {}
        self.live: list[dict[str, _Sample]] = [{} for _ in self.models]  # per engine, by upstream rid
        rng = random.Random(config.seed)
        arrivals: list[_Sample] = []
        for g in range(config.groups):
            prompt = [rng.randrange(1, 50_000) for _ in range(config.prompt_tokens)]
            for k in range(config.n):
                sample = _Sample(
                    request_id=f"g{g:04d}-s{k:02d}",
                    group=g,
                    prompt_ids=prompt,
                    max_new_tokens=rng.randint(config.min_new_tokens, config.max_new_tokens),
                    arrive_at=g * config.arrival_gap_s,
                )
                self.samples[sample.request_id] = sample
                arrivals.append(sample)
        self.arrivals = arrivals  # in time order
        for index in range(config.engines):
            self._execute(
                self.core.handle(
                    EngineJoined(engine_id=f"engine-{index}", capacity=capacity, prefill_token_budget=budget),
                    0.0,
                ),
                0.0,
            )

    def simulate(self) -> GrpoRun:
        now, next_arrival = 0.0, 0
        while True:
            horizon = min(self.core.next_deadline(), *(m.next_event_at() for m in self.models))
            if next_arrival < len(self.arrivals):
                horizon = min(horizon, self.arrivals[next_arrival].arrive_at)
            if horizon == math.inf:
                break
            now = max(now, horizon)
            for index, model in enumerate(self.models):
                for req in model.advance(now):
                    self._stream(index, req, now)
            if now >= self.core.next_deadline():
                self._execute(self.core.on_time(now), now)
            while next_arrival < len(self.arrivals) and self.arrivals[next_arrival].arrive_at <= now:
                self._arrive(self.arrivals[next_arrival], now)
                next_arrival += 1
        self._finish_figures()
        return self.run

    def _arrive(self, sample: _Sample, now: float) -> None:
        arrived = RequestArrived(
            request_id=sample.request_id,
            prompt_tokens=len(sample.prompt_ids),
            group=f"group-{sample.group}" if self.grouped else None,
        )
        self._execute(self.core.handle(arrived, now), now)

    def _stream(self, index: int, req: SimRequest, now: float) -> None:
        sample = self.live[index].get(req.rid)
        if sample is None:
            return
        count, every = req.completion_tokens, self.config.progress_every
        if count > sample.sent and (sample.sent == 0 or count - sample.sent >= every or req.is_finished):
            tokens, sample.sent = count - sample.sent, count
            report = ProgressReported(request_id=sample.request_id, tokens=tokens, attempt=sample.attempt)
            self._execute(self.core.handle(report, now), now)
        if req.is_finished:
            del self.live[index][req.rid]
            finished = UpstreamFinished(request_id=sample.request_id, attempt=sample.attempt)
            self._execute(self.core.handle(finished, now), now)

    def _execute(self, commands: list[Command], now: float) -> None:
        for command in commands:
            if isinstance(command, Dispatch):
                self._dispatch(command, now)
            elif isinstance(command, Complete):
                self.samples[command.request_id].ended_at = now
            elif isinstance(command, Fail):
                self.samples[command.request_id].ended_at = now
                self.samples[command.request_id].failed = True
                self.run.failed_samples += 1
            elif isinstance(command, RecordGroup):
                self.run.group_completion_s.append(command.completion_s)
                self.run.estimated_saved_tokens += command.prefill_tokens_saved
                self.run.groups_finished += command.outcome.value == "finished"

    def _dispatch(self, command: Dispatch, now: float) -> None:
        sample = self.samples[command.request_id]
        index = int(command.engine_id.rpartition("-")[2])
        rid = upstream_id(command.request_id, command.attempt)
        req = SimRequest(
            rid,
            sample.prompt_ids,
            max_new_tokens=sample.max_new_tokens,
            seed=self.config.seed,
            ignore_eos=True,
        )
        sample.attempt, sample.engine, sample.req, sample.sent = command.attempt, index, req, 0
        self.models[index].submit(req, now)
        self.live[index][rid] = sample
        self.run.per_engine_samples[index] += 1

    def _finish_figures(self) -> None:
        run = self.run
        for sample in self.samples.values():
            req = sample.req
            if req is not None:
                run.prompt_tokens += req.prompt_tokens
                run.prefill_tokens += req.prompt_tokens - req.cached_tokens
            if sample.ended_at is not None:
                run.makespan_s = max(run.makespan_s, sample.ended_at)
        if not self.grouped:  # the same arithmetic the core does for groups, from the samples' ends
            ends: dict[int, list[_Sample]] = {}
            for sample in self.samples.values():
                ends.setdefault(sample.group, []).append(sample)
            for members in ends.values():
                if all(s.ended_at is not None for s in members):
                    last = max(s.ended_at for s in members if s.ended_at is not None)
                    run.group_completion_s.append(last - min(s.arrive_at for s in members))
                    run.groups_finished += not any(s.failed for s in members)


def run_grpo(config: GrpoConfig, *, grouped: bool) -> GrpoRun:
    """One run of the workload, its samples sent with their group ids (`grouped`) or without."""
    return _World(config, grouped=grouped).simulate()
