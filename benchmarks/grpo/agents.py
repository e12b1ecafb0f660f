"""Agent trajectories in groups (SkyRL#1791's shape) under one placement, in virtual time.

Theory of operation
-------------------
The shape SkyRL measured `sticky_least_loaded` against consistent hashing on (SkyRL#1791, prime-rl#3563): GRPO
groups of `n` multi-turn agent trajectories. A group's trajectories start together from one prompt; each is a
session (its own routing key, as SkyRL sends one session id per trajectory) of `turns` turns: the model
answers (a seeded length, long-tailed), the tool runs (`tool_s`, the engines idle for it), its output is
appended, and the next turn sends the whole history again. Groups arrive `arrival_gap_s` apart. A trajectory
ends after its last turn; when it ends the trainer releases its session (SessionEnded: the session API's
DELETE, or vllm-router's `/finish_session`), as prime-rl and SkyRL do.

The core and the simulator's engine model run in the virtual-time world (benchmarks/kit/world.py; the
`incident` engine profile: a prefix cache matched on each request's ids, SGLang-like prefill before decode).
Same seed, same workload, for every placement.

Figures per run (simulated seconds): each group's completion (its arrival to its slowest trajectory's end):
p50, p90, max; the prefix-cache hit rate (cached / prompt tokens, the engines' own counts); the sessions each
engine took; the makespan.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.kit.stats import percentile
from benchmarks.kit.world import VirtualWorld
from rolloutgate.config import GatewaySettings
from rolloutgate.core.commands import Command
from rolloutgate.core.events import RequestArrived, SessionEnded
from rolloutsim.profiles import make_config
from rolloutsim.request import SimRequest

__all__ = ("PLACEMENTS", "AgentsConfig", "AgentsRun", "main", "run_agents")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentsConfig:
    engines: int = 4
    groups: int = 32
    n: int = 8  # trajectories per prompt
    prompt_tokens: int = 3000
    min_turns: int = 2
    max_turns: int = 12
    tool_tokens: tuple[int, int] = (300, 1500)  # appended per turn
    answer_median: int = 400  # tokens per answer: log-normal around it, capped
    answer_max: int = 4000
    tool_s: tuple[float, float] = (2.0, 30.0)
    arrival_gap_s: float = 4.0
    progress_every: int = 64
    seed: int = 0
    placement: str = "cache_warm"
    max_excess: int | None = None  # --affinity-max-excess (None: the gateway's default)

    def __post_init__(self) -> None:
        if min(self.engines, self.groups, self.n, self.prompt_tokens, self.min_turns) < 1:
            raise ValueError("engines, groups, n, prompt_tokens and min_turns must be >= 1")
        if self.max_turns < self.min_turns:
            raise ValueError("max_turns must be >= min_turns")


@dataclass(slots=True, kw_only=True)
class AgentsRun:
    placement: str
    group_completion_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    failed_turns: int = 0
    sessions_per_engine: list[int] = field(default_factory=list)
    makespan_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        times = sorted(self.group_completion_s)
        return {
            "placement": self.placement,
            "groups": len(times),
            "group_completion_s": {
                "p50": round(percentile(times, 50), 1),
                "p90": round(percentile(times, 90), 1),
                "max": round(times[-1], 1) if times else math.nan,
            },
            "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
            "failed_turns": self.failed_turns,
            "sessions_per_engine": self.sessions_per_engine,
            "makespan_s": round(self.makespan_s, 1),
        }


@dataclass(slots=True, kw_only=True)
class _Trajectory:
    key: str
    group: int
    history: list[int]
    turns_left: int
    turn: int = 0
    ended_at: float | None = None


class _Agents:
    """The workload: each trajectory's next turn, arriving when its tool is done."""

    def __init__(self, config: AgentsConfig, run: AgentsRun) -> None:
        self.config = config
        self.run = run
        self.rng = random.Random(config.seed)
        self.world: VirtualWorld | None = None
        self.trajectories: dict[str, _Trajectory] = {}
        self.group_start: dict[int, float] = {}
        self.calls: dict[str, tuple[_Trajectory, list[int], int]] = {}  # request id -> its turn's call
        self._due: list[tuple[float, int, str]] = []  # (at, seq, trajectory key)
        self._seq = 0
        for g in range(config.groups):
            start = g * config.arrival_gap_s
            self.group_start[g] = start
            prompt = [self.rng.randrange(1, 50_000) for _ in range(config.prompt_tokens)]
            for k in range(config.n):
                turns = self.rng.randint(config.min_turns, config.max_turns)
                trajectory = _Trajectory(
                    key=f"g{g:03d}-t{k}", group=g, history=list(prompt), turns_left=turns
                )
                self.trajectories[trajectory.key] = trajectory
                self._push(start, trajectory.key)

    def _push(self, at: float, key: str) -> None:
        self._seq += 1
        heapq.heappush(self._due, (at, self._seq, key))

    def next_wakeup_at(self) -> float:
        return self._due[0][0] if self._due else math.inf

    def wake_due(self, now: float) -> None:
        assert self.world is not None
        while self._due and self._due[0][0] <= now:
            _, _, key = heapq.heappop(self._due)
            trajectory = self.trajectories[key]
            answer = min(
                self.config.answer_max, int(self.rng.lognormvariate(math.log(self.config.answer_median), 0.9))
            )
            request_id = f"{key}-turn{trajectory.turn}"
            self.calls[request_id] = (trajectory, list(trajectory.history), max(1, answer))
            arrived = RequestArrived(
                request_id=request_id, prompt_tokens=len(trajectory.history), routing_key=key
            )
            self.world.arrive(arrived, now)

    def prompt(self, request_id: str) -> tuple[list[int], int]:
        _, ids, answer = self.calls[request_id]
        return ids, answer

    def answered(self, request_id: str, at: float) -> None:
        trajectory, ids, answer = self.calls.pop(request_id)
        trajectory.turn += 1
        trajectory.turns_left -= 1
        if trajectory.turns_left == 0:
            self._end(trajectory, at)
            return
        low, high = self.config.tool_tokens
        output = [self.rng.randrange(1, 50_000) for _ in range(answer)]  # stands in for the answer's ids
        tool = [self.rng.randrange(1, 50_000) for _ in range(self.rng.randint(low, high))]
        trajectory.history = ids + output + tool
        self._push(at + self.rng.uniform(*self.config.tool_s), trajectory.key)

    def failed(self, request_id: str, at: float) -> None:
        trajectory, _, _ = self.calls.pop(request_id)
        self.run.failed_turns += 1
        self._end(trajectory, at)

    def _end(self, trajectory: _Trajectory, at: float) -> None:
        assert self.world is not None
        trajectory.ended_at = at
        self.world.arrive(SessionEnded(routing_key=trajectory.key), at)  # the trainer releases it

    def observe(self, command: Command, at: float) -> None:
        return None


def run_agents(config: AgentsConfig) -> AgentsRun:
    """One run of the workload under `config.placement`."""
    run = AgentsRun(placement=config.placement, sessions_per_engine=[0] * config.engines)
    agents = _Agents(config, run)
    excess = {} if config.max_excess is None else {"affinity_max_excess": config.max_excess}
    settings = GatewaySettings(clock="engine", placement=config.placement, **excess)  # type: ignore[arg-type]
    world = agents.world = VirtualWorld(
        settings,
        make_config("incident", record_token_times=True),
        engines=config.engines,
        seed=config.seed,
        progress_every_tokens=config.progress_every,
    )
    world.run(agents)
    last_attempts: dict[str, SimRequest] = {}
    first_engine: dict[str, int] = {}  # each trajectory's first turn's engine
    for index, req in world.generations:
        request_id = req.rid.rpartition("-")[0]
        last_attempts[request_id] = req
        first_engine.setdefault(request_id.rpartition("-turn")[0], index)
    for req in last_attempts.values():
        run.prompt_tokens += req.prompt_tokens
        run.cached_tokens += req.cached_tokens
    for index in first_engine.values():
        run.sessions_per_engine[index] += 1
    ends: dict[int, float] = {}
    for t in agents.trajectories.values():
        if t.ended_at is not None:
            ends[t.group] = max(ends.get(t.group, 0.0), t.ended_at)
            run.makespan_s = max(run.makespan_s, t.ended_at)
    run.group_completion_s = [end - agents.group_start[g] for g, end in ends.items()]
    return run


PLACEMENTS = ("consistent_hash", "sticky_least_loaded", "cache_warm", "prefill_aware")


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.grpo.agents [--seeds 0 1] [--groups 32] [--n 8]`: one row per placement and seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    defaults = AgentsConfig()
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--n", type=int, default=defaults.n)
    parser.add_argument("--arrival-gap", type=float, default=defaults.arrival_gap_s)
    args = parser.parse_args(argv)
    print(
        "| seed | placement | group completion p50 / p90 / max (s) | hit rate | sessions per engine | makespan (s) |"
    )
    print("| ---: | --- | ---: | ---: | --- | ---: |")
    for seed in args.seeds:
        config = AgentsConfig(seed=seed, groups=args.groups, n=args.n, arrival_gap_s=args.arrival_gap)
        for placement in PLACEMENTS:
            s = run_agents(replace(config, placement=placement)).summary()
            times = s["group_completion_s"]
            print(
                f"| {seed} | {placement} | {times['p50']} / {times['p90']} / {times['max']} | "
                f"{s['hit_rate']:.1%} | {s['sessions_per_engine']} | {s['makespan_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
