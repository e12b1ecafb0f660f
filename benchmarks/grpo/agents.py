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

`--profile skyrl1791` (`SKYRL_1791`): the load SkyRL#1791 measured its figure on, closed loop as SkyRL's fully
async trainer runs it (skyrl/train/fully_async_trainer.py at fac7b817c): `workers` group-generation workers each
take a group (`n` trajectories) when the staleness manager allows (`_compute_capacity_unlocked`: at most
`workers` running and `(max_staleness + step) * mini_batch - (accepted + running)`), the trainer takes
`mini_batch` finished groups per step and "trains" `train_s` (the PR's `time.sleep(60)`), and at most
`max_concurrency` trajectories run at once (skyrl/train/utils/rate_limiter.py, the harbor generator's
`async with self._rate_limiter`), the others waiting their turn. A group's completion is then from its
worker's start to its slowest trajectory's end. Each parameter's source is in docs/rl.md's section.
Extra figures per engine: the time each call waited to start on its engine (gateway and engine queue),
its KV use sampled every `probe_s` (mean and peak, % of capacity), and SkyRL's `run_cv` (the spread of
running requests across engines, std / mean, averaged over the samples), and the KV preemptions each engine
made (the profile turns on the engine model's `kv_preemption`: vLLM's recompute preemption when the KV is full).
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
from rolloutsim.profiles import decode_step_s, make_config
from rolloutsim.request import SimRequest

__all__ = ("PLACEMENTS", "PROFILES", "SKYRL_1791", "AgentsConfig", "AgentsRun", "main", "run_agents")


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
    # closed loop (SkyRL's fully async trainer; None: open loop, a group every arrival_gap_s)
    workers: int | None = None  # num_parallel_generation_workers
    mini_batch: int = 4  # policy_mini_batch_size (groups per training step)
    max_staleness: int = 4  # max_staleness_steps
    train_s: float = 60.0  # the simulated training step
    max_concurrency: int | None = None  # trajectories at once (rate limiter); None: no limit
    max_model_len: int | None = None  # a trajectory ends when its next turn would not fit
    token_pool: bool = False  # new ids sliced from one seeded pool (fast), not drawn one by one
    probe_s: float = 0.0  # sample each engine's KV use and running requests this often (0: never)
    # engine overrides on the `incident` profile (None: the profile's)
    kv_capacity_tokens: int | None = None
    decode_base_s: float | None = None
    decode_per_ktoken_s: float | None = None
    kv_preemption: bool = (
        False  # preempt the newest request when a step would overflow the KV (vLLM recompute)
    )
    prefill_tokens_per_s: float | None = None
    prefix_block_tokens: int | None = None
    prefill_mode: str | None = None  # "mixed": vLLM's chunked prefill beside the decodes
    chunked_prefill_size: int | None = None  # vLLM: max_num_batched_tokens
    uuid_keys: bool = False  # routing keys drawn as uuid4 hex (SkyRL's harbor generator), not g000-t0

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
    wait_s: list[list[float]] = field(default_factory=list)  # per engine: each call's wait to start there
    kv_used: list[list[float]] = field(default_factory=list)  # per engine: sampled KV use / capacity
    running: list[list[int]] = field(default_factory=list)  # per sample: running requests per engine
    engine_hit_rate: list[float] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)  # per engine: KV preemptions (the engines' counters)
    peak_trajectories: int = 0  # closed loop: most trajectories running at once
    peak_groups: int = 0  # closed loop: most groups being generated at once

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

    def engine_summary(self) -> dict[str, Any]:
        """What each engine went through: waits to start, KV use, SkyRL's run_cv."""
        times = self.group_completion_s
        cvs = []
        for sample in self.running:
            mean = sum(sample) / len(sample)
            if mean > 0:
                cvs.append(math.sqrt(sum((x - mean) ** 2 for x in sample) / len(sample)) / mean)
        return {
            "group_mean_s": round(sum(times) / len(times), 1) if times else math.nan,
            "group_min_s": round(min(times), 1) if times else math.nan,
            "wait_mean_s": [round(sum(w) / len(w), 1) if w else 0.0 for w in self.wait_s],
            "wait_p90_s": [round(percentile(sorted(w), 90), 1) if w else 0.0 for w in self.wait_s],
            "kv_mean": [round(sum(k) / len(k), 2) if k else 0.0 for k in self.kv_used],
            "kv_max": [round(max(k), 2) if k else 0.0 for k in self.kv_used],
            "run_cv": round(sum(cvs) / len(cvs), 3) if cvs else 0.0,
            "running_mean": round(sum(map(sum, self.running)) / len(self.running), 1)
            if self.running
            else 0.0,
            "engine_hit_rate": [round(h, 3) for h in self.engine_hit_rate],
            "preemptions": self.preemptions,
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
        self.arrived_at: dict[str, float] = {}  # request id -> when it reached the gateway
        self._due: list[tuple[float, int, str]] = []  # (at, seq, trajectory key)
        self._seq = 0
        self._pool: list[int] = []
        if config.token_pool:
            self._pool = [self.rng.randrange(1, 50_000) for _ in range(1 << 20)]
        if config.workers is not None:
            self._loop = _ClosedLoop(config, self)
            return
        for g in range(config.groups):
            self._start_group(g, g * config.arrival_gap_s)

    def _start_group(self, g: int, start: float) -> list[_Trajectory]:
        config = self.config
        self.group_start[g] = start
        prompt = self._ids(config.prompt_tokens)
        group = []
        for k in range(config.n):
            turns = self.rng.randint(config.min_turns, config.max_turns)
            key = f"{self.rng.getrandbits(128):032x}" if config.uuid_keys else f"g{g:03d}-t{k}"
            trajectory = _Trajectory(key=key, group=g, history=list(prompt), turns_left=turns)
            self.trajectories[trajectory.key] = trajectory
            group.append(trajectory)
            if config.workers is None:
                self._push(start, trajectory.key)
        return group

    def _ids(self, count: int) -> list[int]:
        """`count` fresh token ids."""
        if self._pool:
            at = self.rng.randrange(len(self._pool) - count)
            return self._pool[at : at + count]
        return [self.rng.randrange(1, 50_000) for _ in range(count)]

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
            self.arrived_at[request_id] = now
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
        output = self._ids(answer)  # stands in for the answer's ids
        tool = self._ids(self.rng.randint(low, high))
        trajectory.history = ids + output + tool
        limit = self.config.max_model_len
        if limit is not None and len(trajectory.history) + self.config.answer_max > limit:
            self._end(trajectory, at)  # its next turn would not fit the context
            return
        self._push(at + self.rng.uniform(*self.config.tool_s), trajectory.key)

    def failed(self, request_id: str, at: float) -> None:
        trajectory, _, _ = self.calls.pop(request_id)
        self.run.failed_turns += 1
        self._end(trajectory, at)

    def _end(self, trajectory: _Trajectory, at: float) -> None:
        assert self.world is not None
        trajectory.ended_at = at
        self.world.arrive(SessionEnded(routing_key=trajectory.key), at)  # the trainer releases it
        if self.config.workers is not None:
            self._loop.trajectory_ended(trajectory, at)

    def observe(self, command: Command, at: float) -> None:
        return None


class _ClosedLoop:
    """SkyRL's fully async trainer (module docstring): workers, staleness capacity, trainer, rate limiter."""

    def __init__(self, config: AgentsConfig, agents: _Agents) -> None:
        assert config.workers is not None
        self.config = config
        self.agents = agents
        self.idle_workers = config.workers
        self.step = 1  # the version being worked on (SkyRL's `_current_global_step`)
        self.running = 0  # groups being generated
        self.accepted = 0  # groups finished
        self.buffered = 0  # finished, not yet trained on
        self.training = False
        self.started = 0
        self.left: dict[int, int] = {}  # group -> trajectories not yet ended
        self.slots = config.max_concurrency if config.max_concurrency is not None else math.inf
        self.waiting: list[_Trajectory] = []  # for a rate-limiter slot, first come first served
        self._next_waiting = 0
        self.active = 0  # trajectories admitted and not ended

    def capacity(self) -> float:
        config = self.config
        staleness = (config.max_staleness + self.step) * config.mini_batch - (self.accepted + self.running)
        return min(self.idle_workers, staleness)

    def start_work(self, now: float) -> None:
        while self.started < self.config.groups and self.capacity() > 0:
            g = self.started
            self.started += 1
            self.idle_workers -= 1
            self.running += 1
            self.agents.run.peak_groups = max(self.agents.run.peak_groups, self.running)
            group = self.agents._start_group(g, now)
            self.left[g] = len(group)
            self.waiting.extend(group)
        self._admit(now)

    def _admit(self, now: float) -> None:
        while self.slots > 0 and self._next_waiting < len(self.waiting):
            trajectory = self.waiting[self._next_waiting]
            self._next_waiting += 1
            self.slots -= 1
            self.agents._push(now, trajectory.key)
            self.active += 1
            self.agents.run.peak_trajectories = max(self.agents.run.peak_trajectories, self.active)

    def trajectory_ended(self, trajectory: _Trajectory, at: float) -> None:
        self.slots += 1
        self.active -= 1
        self.left[trajectory.group] -= 1
        if self.left[trajectory.group] == 0:
            self.running -= 1
            self.accepted += 1
            self.buffered += 1
            self.idle_workers += 1
            self._train(at)
        self.start_work(at)

    def _train(self, now: float) -> None:
        if self.training or self.buffered < self.config.mini_batch:
            return
        assert self.agents.world is not None
        self.buffered -= self.config.mini_batch
        self.training = True
        self.agents.world.schedule(now + self.config.train_s, self._trained)

    def _trained(self, now: float) -> None:
        self.training = False
        self.step += 1
        self._train(now)
        self.start_work(now)


class _PreemptingWorld(VirtualWorld):
    """The virtual world for engines that preempt (`kv_preemption`): an engine running decodes only is looked at
    again no later than the step its KV room runs out at, where it may preempt (the world's prediction of its
    first finish assumes the batch stays whole); the engine model stops its decode bursts there too."""

    def _first_finish_at(self, index: int, horizon: float) -> float:
        at = super()._first_finish_at(index, horizon)
        model = self.engines[index]
        requests = [a.req for a in self._live[index].values()]
        room = self.engine_config.kv_capacity_tokens - model.kv_used_tokens
        steps = max(1, room // len(requests))
        if steps >= min(r.limit - r.completion_tokens for r in requests):
            return at
        until = model.next_event_at()
        context = sum(r.context_tokens for r in requests)
        for _ in range(steps - 1):
            context += len(requests)
            until += decode_step_s(self.engine_config, len(requests), context)
            if until > horizon:
                break
        return min(at, until)


def _probe(world: VirtualWorld, run: AgentsRun, every: float, capacity: int, agents: _Agents) -> None:
    def sample(now: float) -> None:
        run.running.append([model.running_count for model in world.engines])
        for index, model in enumerate(world.engines):
            run.kv_used[index].append(model.kv_used_tokens / capacity)
        started = len(agents.group_start) == agents.config.groups
        if not started or any(t.ended_at is None for t in agents.trajectories.values()):
            world.schedule(now + every, sample)

    world.schedule(every, sample)


def run_agents(config: AgentsConfig) -> AgentsRun:
    """One run of the workload under `config.placement`."""
    run = AgentsRun(placement=config.placement, sessions_per_engine=[0] * config.engines)
    agents = _Agents(config, run)
    excess = {} if config.max_excess is None else {"affinity_max_excess": config.max_excess}
    settings = GatewaySettings(clock="engine", placement=config.placement, **excess)  # type: ignore[arg-type]
    engine = make_config(
        "incident",
        record_token_times=True,
        kv_capacity_tokens=config.kv_capacity_tokens,
        decode_base_s=config.decode_base_s,
        decode_per_ktoken_s=config.decode_per_ktoken_s,
        kv_preemption=config.kv_preemption or None,
        prefill_tokens_per_s=config.prefill_tokens_per_s,
        prefix_block_tokens=config.prefix_block_tokens,
        prefill_mode=config.prefill_mode,
        chunked_prefill_size=config.chunked_prefill_size,
    )
    world = agents.world = (_PreemptingWorld if engine.kv_preemption else VirtualWorld)(
        settings,
        engine,
        engines=config.engines,
        seed=config.seed,
        progress_every_tokens=config.progress_every,
    )
    run.wait_s = [[] for _ in range(config.engines)]
    run.kv_used = [[] for _ in range(config.engines)]
    if config.probe_s > 0:
        _probe(world, run, config.probe_s, engine.kv_capacity_tokens, agents)
    if config.workers is not None:
        agents._loop.start_work(0.0)
    world.run(agents)
    run.preemptions = [model.stats.preempted_total for model in world.engines]
    last_attempts: dict[str, SimRequest] = {}
    first_engine: dict[str, int] = {}  # each trajectory's first turn's engine
    for index, req in world.generations:
        request_id = req.rid.rpartition("-")[0]
        last_attempts[request_id] = req
        first_engine.setdefault(request_id.rpartition("-turn")[0], index)
    engine_of = {req.rid: index for index, req in world.generations}
    prompt = [0] * config.engines
    cached = [0] * config.engines
    for request_id, req in last_attempts.items():
        run.prompt_tokens += req.prompt_tokens
        run.cached_tokens += req.cached_tokens
        index = engine_of[req.rid]
        prompt[index] += req.prompt_tokens
        cached[index] += req.cached_tokens
        if req.started_at is not None and request_id in agents.arrived_at:
            run.wait_s[index].append(req.started_at - agents.arrived_at[request_id])
    run.engine_hit_rate = [c / p if p else 0.0 for c, p in zip(cached, prompt, strict=True)]
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

# SkyRL#1791's "Moderate" run (staleness 4), as far as its PR says it; docs/rl.md's section gives each field's
# source or marks it an assumption.
SKYRL_1791 = AgentsConfig(
    engines=4,  # num_engines=4 (GLM 4.7, TP 8, 4 x 8xB200)
    groups=24,  # "averaged over 5 steps" after dropping the first: 6 steps of mini_batch groups
    n=16,  # n_samples_per_prompt=16
    workers=12,  # num_parallel_generation_workers=12
    mini_batch=4,  # mini_batch=4
    max_staleness=4,  # max_staleness=4 (the group latency table's runs)
    train_s=60.0,  # time.sleep(60) instead of a training step
    max_concurrency=132,  # max_concurrency=132
    max_model_len=128_000,  # max_model_len=128000
    min_turns=20,  # "~40 turn": assumed uniform 20-60
    max_turns=60,
    prompt_tokens=3000,  # assumed (the default shape's)
    answer_median=130,  # ~7.8K generated tokens per trajectory (gen_tok/s / traj/s) over ~40 turns
    answer_max=4000,
    tool_tokens=(300, 1300),  # running requests' mean context ~20K (kv_avg x capacity / running): ~1K a turn
    tool_s=(1.0, 10.0),  # assumed: ~58% of trajectories in the engine (running 76 of 132)
    kv_capacity_tokens=876_000,  # gpu_memory_utilization=0.75 on a B200 with GLM 4.7 TP 8 (derived)
    decode_base_s=0.030,  # TPOT ~40 ms at low pressure (TPOT table)
    # KV read per decode step (reference/engines.md's estimate: bytes / HBM bandwidth / ~0.7): 47,104 bytes a
    # token a GPU (above) / (8 TB/s, B200's HBM3e, x 0.7) = 8.4 us per 1K tokens of the batch's context
    decode_per_ktoken_s=0.0000084,
    kv_preemption=True,  # vLLM's recompute preemption when the KV is full (SkyRL: 32 against 6)
    prefill_tokens_per_s=40_000.0,  # assumed (TTFT ~0.2 s at low pressure bounds it only from below)
    prefill_mode="mixed",  # vLLM engines (vllm-router): chunked prefill beside the decodes
    chunked_prefill_size=8192,  # assumed vLLM's default max_num_batched_tokens for an API server
    uuid_keys=True,  # session_id = uuid4().hex (harbor_generator.py)
    prefix_block_tokens=64,  # assumed coarser than vLLM's 16 to keep the run short
    token_pool=True,
    probe_s=10.0,
)
PROFILES = {"default": AgentsConfig(), "skyrl1791": SKYRL_1791}


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.grpo.agents [--profile skyrl1791] [--seeds 0 1] [--groups 32] [--n 8]`: one row per
    placement and seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS))
    parser.add_argument("--groups", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--arrival-gap", type=float)
    parser.add_argument("--kv-capacity", type=int, help="tokens of KV per engine (the pressure knob)")
    parser.add_argument("--max-excess", type=int, help="--affinity-max-excess")
    args = parser.parse_args(argv)
    base = PROFILES[args.profile]
    changes = {
        "groups": args.groups,
        "n": args.n,
        "arrival_gap_s": args.arrival_gap,
        "kv_capacity_tokens": args.kv_capacity,
        "max_excess": args.max_excess,
    }
    base = replace(base, **{k: v for k, v in changes.items() if v is not None})
    closed = base.workers is not None
    if closed:
        print(
            "| seed | placement | group min / p50 / p90 / max / mean (s) | hit rate | sessions per engine "
            "| wait to start, mean per engine (s) | KV mean / peak per engine (%) | run_cv | running "
            "| preemptions per engine (total) | makespan (s) |"
        )
        print("| ---: | --- | ---: | ---: | --- | --- | --- | ---: | ---: | --- | ---: |")
    else:
        print(
            "| seed | placement | group completion p50 / p90 / max (s) | hit rate | sessions per engine "
            "| makespan (s) |"
        )
        print("| ---: | --- | ---: | ---: | --- | ---: |")
    for seed in args.seeds:
        config = replace(base, seed=seed)
        for placement in args.placements:
            run = run_agents(replace(config, placement=placement))
            s = run.summary()
            times = s["group_completion_s"]
            if not closed:
                print(
                    f"| {seed} | {placement} | {times['p50']} / {times['p90']} / {times['max']} | "
                    f"{s['hit_rate']:.1%} | {s['sessions_per_engine']} | {s['makespan_s']} |",
                    flush=True,
                )
                continue
            e = run.engine_summary()
            kv = " ".join(f"{m:.0%}/{x:.0%}" for m, x in zip(e["kv_mean"], e["kv_max"], strict=True))
            print(
                f"| {seed} | {placement} | {e['group_min_s']} / {times['p50']} / {times['p90']} / {times['max']} / "
                f"{e['group_mean_s']} | {s['hit_rate']:.1%} | {s['sessions_per_engine']} | {e['wait_mean_s']} | "
                f"{kv} | {e['run_cv']} | {e['running_mean']} | {e['preemptions']} ({sum(e['preemptions'])}) | "
                f"{s['makespan_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
