"""A GRPO-shaped workload on the gateway's core and the simulator's engine model, in virtual time.

Theory of operation
-------------------
The shape of a GRPO rollout step: `groups` prompts of `prompt_tokens` each (distinct token ids per prompt),
`n` samples of each prompt sent together, the groups arriving `arrival_gap_s` apart, every sample decoding
its own length (seeded, uniform in [min_new_tokens, max_new_tokens]). The same workload runs twice, same seed,
same placement (the production default, prefill-aware): once with each sample's group id
(`RequestArrived.group`, what the front reads from `X-Rolloutgate-Group` or the body's `rolloutgate_group`),
once without.

No HTTP and no real time: the virtual-time world (benchmarks/kit/world.py, the one the exact world of the
incident replay runs on) couples `core.gateway.Gateway` to one `sim.engine_model.EngineModel` per engine (the
`incident` profile: SGLang-like prefill before decode, a prefix cache matched when a request is admitted,
4,600 prefill tokens/s), stopping at every engine step; the samples are its workload, arriving at their
times. A dispatched sample is submitted to its engine at once; its first token, then every `progress_every`-th
token, then its end are told to the core at the time the engine produced them, as server/driver.py does.

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

from benchmarks.kit.stats import percentile
from benchmarks.kit.world import VirtualWorld
from rolloutgate.config import GatewaySettings
from rolloutgate.core.commands import Command, RecordGroup
from rolloutgate.core.events import RequestArrived
from rolloutsim.profiles import make_config
from rolloutsim.request import SimRequest

__all__ = ("GrpoConfig", "GrpoRun", "run_grpo")


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


@dataclass(slots=True)
class _Sample:
    request_id: str
    group: int
    prompt_ids: list[int]
    max_new_tokens: int
    arrive_at: float
    ended_at: float | None = None
    failed: bool = False


class _Samples:
    """The workload: every sample, arriving at its time, with or without its group id."""

    def __init__(self, config: GrpoConfig, *, grouped: bool, run: GrpoRun) -> None:
        self.grouped = grouped
        self.run = run
        self.world: VirtualWorld | None = None
        self.samples: dict[str, _Sample] = {}
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
        self._next = 0

    def next_wakeup_at(self) -> float:
        return self.arrivals[self._next].arrive_at if self._next < len(self.arrivals) else math.inf

    def wake_due(self, now: float) -> None:
        assert self.world is not None
        while self._next < len(self.arrivals) and self.arrivals[self._next].arrive_at <= now:
            sample = self.arrivals[self._next]
            arrived = RequestArrived(
                request_id=sample.request_id,
                prompt_tokens=len(sample.prompt_ids),
                group=f"group-{sample.group}" if self.grouped else None,
            )
            self.world.arrive(arrived, now)
            self._next += 1

    def prompt(self, request_id: str) -> tuple[list[int], int]:
        sample = self.samples[request_id]
        return sample.prompt_ids, sample.max_new_tokens

    def answered(self, request_id: str, at: float) -> None:
        self.samples[request_id].ended_at = at

    def failed(self, request_id: str, at: float) -> None:
        self.samples[request_id].ended_at = at
        self.samples[request_id].failed = True
        self.run.failed_samples += 1

    def observe(self, command: Command, at: float) -> None:
        if isinstance(command, RecordGroup):
            self.run.group_completion_s.append(command.completion_s)
            self.run.estimated_saved_tokens += command.prefill_tokens_saved
            self.run.groups_finished += command.outcome.value == "finished"


def run_grpo(config: GrpoConfig, *, grouped: bool) -> GrpoRun:
    """One run of the workload, its samples sent with their group ids (`grouped`) or without."""
    run = GrpoRun(grouped=grouped, per_engine_samples=[0] * config.engines)
    samples = _Samples(config, grouped=grouped, run=run)
    settings = GatewaySettings(clock="engine", placement=config.placement)  # type: ignore[arg-type]
    world = samples.world = VirtualWorld(
        settings,
        make_config("incident", record_token_times=True),
        engines=config.engines,
        seed=config.seed,
        progress_every_tokens=config.progress_every,
        step_by_step=True,
        observe=samples.observe,
    )
    world.run(samples)
    last_attempts: dict[str, SimRequest] = {}  # by request id (the upstream id: <request id>-<attempt>)
    for index, req in world.generations:
        run.per_engine_samples[index] += 1
        last_attempts[req.rid.rpartition("-")[0]] = req
    for req in last_attempts.values():
        run.prompt_tokens += req.prompt_tokens
        run.prefill_tokens += req.prompt_tokens - req.cached_tokens
    for sample in samples.samples.values():
        if sample.ended_at is not None:
            run.makespan_s = max(run.makespan_s, sample.ended_at)
    if not grouped:  # the same arithmetic the core does for groups, from the samples' ends
        ends: dict[int, list[_Sample]] = {}
        for sample in samples.samples.values():
            ends.setdefault(sample.group, []).append(sample)
        for members in ends.values():
            if all(s.ended_at is not None for s in members):
                last = max(s.ended_at for s in members if s.ended_at is not None)
                run.group_completion_s.append(last - min(s.arrive_at for s in members))
                run.groups_finished += not any(s.failed for s in members)
    return run
