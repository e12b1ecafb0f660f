"""Length bias of the staleness bound: `--on-stale requeue` against `pace`, in virtual time (issue 35 item 3).

Theory of operation
-------------------
An asynchronous RL loop (AReaL's shape): `workers` rollout workers each send one generation at a time (no
session, a 500-token prompt, a long-tailed asked length generated to the end); a trainer takes finished samples
in the order they finished, `batch` per step, trains for `train_s`, then updates the weights (the gateway is told
`WeightsUpdated`), while generation goes on. The staleness bound is `max_staleness` K.

- `requeue`: at each update a generation running since more than K versions back is aborted and run again from
  scratch. A generation longer than about K + 1 steps can never finish: the long answers are the ones thrown
  away, so what the trainer gets is shorter than what was asked (tinker-cookbook#822).
- `pace`: nothing is aborted; the gateway admits at most `batch` x (version + K + 1) generations, so new work
  waits while the trainer is behind (core/pace.py), and what is admitted is delivered whole.

The core and the simulator's engine model run in the virtual-time world (benchmarks/kit/world.py; the
`incident` engine profile). Same seed, same asked lengths, for both modes.

Figures per run: the asked length of every generation sent (median, p90) against the generated length of what
the trainer consumed (median, p90, and its shift from asked); the staleness of what it consumed (its version at
consumption minus the version its delivered attempt started under: max and mean); the engines' tokens thrown
away (aborted attempts); the steps done and the simulated time.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from benchmarks.kit.stats import percentile
from benchmarks.kit.world import VirtualWorld
from rolloutgate.config import GatewaySettings
from rolloutgate.core.events import RequestArrived, WeightsUpdated
from rolloutgate.core.weights import OnStale
from rolloutsim.profiles import make_config

__all__ = ("MODES", "StalenessConfig", "StalenessRun", "main", "run_staleness")

MODES: tuple[OnStale, ...] = ("requeue", "pace")


@dataclass(frozen=True, slots=True, kw_only=True)
class StalenessConfig:
    mode: OnStale = "pace"
    engines: int = 4
    workers: int = 256
    batch: int = 128  # samples per training step
    steps: int = 48
    max_staleness: int = 1
    train_s: float = 20.0
    prompt_tokens: int = 500
    asked_median: int = 1200  # log-normal around it, capped: a long tail of long answers
    asked_sigma: float = 1.0
    asked_max: int = 16_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")


@dataclass(slots=True, kw_only=True)
class StalenessRun:
    config: StalenessConfig
    asked: list[int] = field(default_factory=list)  # every generation sent
    consumed: list[str] = field(default_factory=list)  # what the trainer took, in order
    delivered: list[int] = field(default_factory=list)  # the generated length of each, once the run is over
    staleness: list[int] = field(default_factory=list)
    wasted_tokens: int = 0
    admitted: int = 0  # generations the gateway let start (dispatched at least once)
    steps_done: int = 0
    end_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        asked, delivered = sorted(self.asked), sorted(self.delivered)
        a50, a90 = percentile(asked, 50), percentile(asked, 90)
        d50, d90 = percentile(delivered, 50), percentile(delivered, 90)
        return {
            "mode": self.config.mode,
            "seed": self.config.seed,
            "asked": {"p50": round(a50), "p90": round(a90)},
            "delivered": {"p50": round(d50), "p90": round(d90)},
            "shift": {"p50": round(d50 / a50 - 1, 4), "p90": round(d90 / a90 - 1, 4)},
            "staleness": {
                "max": max(self.staleness, default=0),
                "mean": round(sum(self.staleness) / len(self.staleness), 2) if self.staleness else 0.0,
            },
            "wasted_tokens": self.wasted_tokens,
            "steps": self.steps_done,
            "end_s": round(self.end_s, 1),
        }


class _Loop:
    """The workload: the workers' closed loop and the trainer's steps."""

    def __init__(self, config: StalenessConfig, run: StalenessRun) -> None:
        self.config = config
        self.run = run
        self.rng = random.Random(config.seed)
        self.world: VirtualWorld | None = None
        self.version = 0
        self.calls: dict[str, tuple[list[int], int]] = {}
        self.started_version: dict[str, int] = {}
        self.finished: deque[str] = deque()
        self.training_until: float | None = None
        self.count = 0
        self.wake_at = 0.0  # the workers start at 0

    def next_wakeup_at(self) -> float:
        return self.wake_at

    def wake_due(self, now: float) -> None:
        if now < self.wake_at:
            return
        self.wake_at = math.inf
        if self.training_until is not None:  # a step's training ended: the new weights
            self.training_until = None
            self.version += 1
            self.run.steps_done += 1
            self._world().arrive(WeightsUpdated(engine_version=f"step-{self.version}"), now)
            self._maybe_train(now)
            return
        for _ in range(self.config.workers):  # the start
            self._send(now)

    def _world(self) -> VirtualWorld:
        assert self.world is not None
        return self.world

    def _send(self, now: float) -> None:
        self.count += 1
        request_id = f"r{self.count:06d}"
        asked = min(
            self.config.asked_max,
            max(1, int(self.rng.lognormvariate(math.log(self.config.asked_median), self.config.asked_sigma))),
        )
        ids = [self.rng.randrange(1, 50_000) for _ in range(self.config.prompt_tokens)]
        self.calls[request_id] = (ids, asked)
        self.run.asked.append(asked)
        self._world().arrive(RequestArrived(request_id=request_id, prompt_tokens=len(ids)), now)

    def prompt(self, request_id: str) -> tuple[list[int], int]:
        # the world asks at each dispatch: the version the attempt starts under
        self.started_version[request_id] = self.version
        return self.calls[request_id]

    def answered(self, request_id: str, at: float) -> None:
        self.finished.append(request_id)
        if self.run.steps_done < self.config.steps:
            self._send(at)  # the worker's next generation
        self._maybe_train(at)

    def failed(self, request_id: str, at: float) -> None:
        raise AssertionError(f"{request_id} failed: this workload has no timeouts")

    def _maybe_train(self, now: float) -> None:
        if self.training_until is not None or self.run.steps_done >= self.config.steps:
            return
        if len(self.finished) < self.config.batch:
            return
        for _ in range(self.config.batch):
            request_id = self.finished.popleft()
            self.run.staleness.append(self.version - self.started_version[request_id])
            self.run.consumed.append(request_id)
        self.training_until = self.wake_at = now + self.config.train_s
        self.run.end_s = now


def run_staleness(config: StalenessConfig) -> StalenessRun:
    run = StalenessRun(config=config)
    loop = _Loop(config, run)
    settings = GatewaySettings(
        clock="engine",
        max_staleness=config.max_staleness,
        on_stale=config.mode,
        pace_batch=config.batch if config.mode == "pace" else None,
    )
    world = loop.world = VirtualWorld(
        settings,
        make_config("incident", record_token_times=True),
        engines=config.engines,
        seed=config.seed,
    )
    world.run(loop)
    generated: dict[str, int] = {}  # each request's last attempt: the one that answered it
    for _index, req in world.generations:
        generated[req.rid.rpartition("-")[0]] = req.completion_tokens
        if req.finish is not None and req.finish.kind == "abort":
            run.wasted_tokens += req.completion_tokens
    run.delivered = [generated[request_id] for request_id in run.consumed]
    run.admitted = len(loop.started_version)
    return run


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.grpo.staleness [--seeds 0 1 2]`: one row per mode and seed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    defaults = StalenessConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    args = parser.parse_args(argv)
    print(
        "| seed | --on-stale | asked p50 / p90 | delivered p50 / p90 | shift p50 / p90 | staleness max / mean | "
        "tokens thrown away | steps | time (s) |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seed in args.seeds:
        for mode in MODES:
            config = StalenessConfig(mode=mode, seed=seed, steps=args.steps, max_staleness=args.max_staleness)
            s = run_staleness(config).summary()
            print(
                f"| {seed} | {mode} | {s['asked']['p50']} / {s['asked']['p90']} | "
                f"{s['delivered']['p50']} / {s['delivered']['p90']} | "
                f"{s['shift']['p50']:+.1%} / {s['shift']['p90']:+.1%} | "
                f"{s['staleness']['max']} / {s['staleness']['mean']} | {s['wasted_tokens']:,} | "
                f"{s['steps']} | {s['end_s']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
