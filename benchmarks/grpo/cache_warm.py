"""The prefix-cache hit rate of the incident replay's load under one placement, in the exact world.

Theory of operation: benchmarks/prefill/exact_world.py runs the replay's agents (multi-turn sessions whose
histories grow to 100K tokens, storms of new long sessions) on the sans-IO core and the simulator's engine
model in virtual time; its core is built from the production settings. `run_placed` runs the same world with
the core's settings under another placement (`cache_warm`, `least_outstanding`, ...), and reads each engine's
hit rate from the engines' own counts (cached / prompt tokens of every generation there). With `engine_cache_tokens` the engines' KV capacity is told to cache-warm placement.

Least outstanding work places each turn on whichever engine has the fewest requests in flight, so a session's
turns wander and most of them find their history in no cache; cache-warm placement keeps each session where
its history is and spreads new sessions by the sessions bound to each engine (placement/cache_warm.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from benchmarks.prefill.exact_world import ExactRecords, ExactWorld
from benchmarks.prefill.measure import MODE_SETTINGS
from rolloutgate.config import GatewaySettings
from rolloutreplay.scenario import ReplayConfig

__all__ = ("HitRates", "hit_rates", "main", "run_placed")


@dataclass(frozen=True, slots=True, kw_only=True)
class HitRates:
    """Prefix-cache hits of one run (cached / prompt tokens): per engine, overall, and over the later turns of
    the sessions (after each one's first: the turns whose history a cache can hold)."""

    per_engine: dict[int, float]
    overall: float
    later_turns: float
    prompt_tokens: int
    cached_tokens: int


def run_placed(
    config: ReplayConfig, placement: str, *, engine_cache_tokens: int | None = None
) -> ExactRecords:
    """One exact run of the replay's load with `placement` (prefill-aware admission on, as production)."""
    settings = GatewaySettings(
        clock="engine",
        timeout=config.gateway_timeout_s,
        stall_timeout=config.stall_timeout_s,
        placement=placement,  # type: ignore[arg-type]
        engine_cache_tokens=engine_cache_tokens,
        **MODE_SETTINGS["on"],
    )
    return ExactWorld(config, "on", settings=settings).run()


def hit_rates(records: ExactRecords) -> HitRates:
    """Each engine's prefix-cache hit rate over the run's generations, the pool's, and the later turns'."""
    later = {rid for t in records.turns if t["turn"] > 0 for rid in t["request_ids"]}
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    later_prompt = later_cached = 0
    for generation in records.generations:
        engine = generation["engine"]
        prompt[engine] = prompt.get(engine, 0) + generation["prompt_tokens"]
        cached[engine] = cached.get(engine, 0) + generation["cached_tokens"]
        if generation["rid"].rpartition("-")[0] in later:  # the upstream id: <request id>-<attempt>
            later_prompt += generation["prompt_tokens"]
            later_cached += generation["cached_tokens"]
    total_prompt, total_cached = sum(prompt.values()), sum(cached.values())
    return HitRates(
        per_engine={e: cached[e] / prompt[e] for e in sorted(prompt) if prompt[e]},
        overall=total_cached / total_prompt if total_prompt else 0.0,
        later_turns=later_cached / later_prompt if later_prompt else 0.0,
        prompt_tokens=total_prompt,
        cached_tokens=total_cached,
    )


def main(argv: list[str] | None = None) -> int:
    defaults = ReplayConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.grpo.cache_warm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--placements", default="cache_warm,least_outstanding,prefill_aware")
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--duration", type=float, default=1200.0, help="simulated seconds")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--engine-cache-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    config = replace(defaults, agents=args.agents, duration_s=args.duration, seed=args.seed)
    print(
        f"the replay's load: {config.agents} agents, {config.engines} engines, {config.duration_s:g} s, seed {config.seed}\n"
    )
    print("| placement | hit rate, all turns | later turns | per engine |")
    print("| --- | ---: | ---: | --- |")
    for placement in args.placements.split(","):
        rates = hit_rates(run_placed(config, placement, engine_cache_tokens=args.engine_cache_tokens))
        engines = " ".join(f"{rate:.0%}" for rate in rates.per_engine.values())
        print(f"| {placement} | {rates.overall:.1%} | {rates.later_turns:.1%} | {engines} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
