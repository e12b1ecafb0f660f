"""Prefill storms, side by side: the gateway without prefill-aware admission ("off") and with it ("on").

    python -m benchmarks.prefill.storm [--seeds 0,1,2,3] [--agents 16] [--storm-sessions 16] [--out DIR]

Theory of operation
-------------------
Each mode runs the same workload, decided from the seed before anything starts, against its own simulated SGLang
engines (`incident` profile: a lone decode at ~70 tok/s, a 100K-token prefill in ~36 s during which the
engine's decodes get 4-8 tok/s, docs/simulator.md) behind a real gateway (server/app.py, HTTP all the way):

- agents: each runs sessions one after the other, like the incident replay (rolloutreplay/scenario.py): a
  session starts with a 90-110K-token history (cold: nothing cached anywhere), then 4 turns (an opening turn of
  2-4K tokens, then medium 7-13K or long 23-25K ones), 5-20 s of tool time between turns, the history growing
  by 1K tokens of the answer and 1K of tool output; every later turn is a warm long-history session (its
  prefix is cached on the engine that ran its previous turn). Native `/generate` with token ids,
  non-streaming, `X-Session-Id` as the routing key, no client timeout;
- storms: at fixed fractions of the run, `storm_sessions` new sessions arrive at once, each with a cold
  90-110K-token history and one turn of 1-2K tokens (a rollout step starting: more long prompts than engines).

Modes (benchmarks/prefill/measure.py `MODE_SETTINGS`): `off` is the gateway as it was before prefill-aware admission
(session affinity, no prefill budget, no rest); `on` is the gateway's defaults: prefill-aware placement with the
prefill budget derived from the engines' chunk size and capacity, small prefills exempt, and the rest after long
prefills (docs/prefill.md).

Figures, in simulated seconds, as benchmarks/prefill/measure.py defines them (engine side from each generation's
token times, `record_token_times=True`; gateway side from every request's timing breakdown): the co-located
decode rate during storms, total tokens per second, turn latency (p50, p99), uncharged contention; and here
also the warm turns' time to first token, the slowest storm turn and the storms' spans.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.prefill.measure import (
    MODE_SETTINGS,
    MODES,
    PERCENTILES,
    Row,
    decode_during_storms,
    generations_of,
    last_attempts,
    parse_seeds,
    pool,
    shared_figures,
    table,
    turn_times,
)
from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.server.app import GatewayServer
from rolloutsim import SimCluster

__all__ = ("ROWS", "StormConfig", "main", "measure", "run_mode")


@dataclass(frozen=True, slots=True, kw_only=True)
class StormConfig:
    """One run. Durations are simulated seconds; `time_scale` simulated seconds pass per real second."""

    engines: int = 4
    agents: int = 16
    storm_sessions: int = 16
    storms_at: tuple[float, ...] = (0.25, 0.65)  # fractions of the duration
    duration_s: float = 1800.0
    time_scale: float = 25.0
    seed: int = 0
    history_tokens: tuple[int, int] = (90_000, 110_000)
    opening_tokens: tuple[int, int] = (2_000, 4_000)
    medium_tokens: tuple[int, int] = (7_000, 13_000)
    long_tokens: tuple[int, int] = (23_000, 25_000)
    long_share: float = 0.35
    storm_tokens: tuple[int, int] = (1_000, 2_000)
    turns_per_session: int = 4
    tool_tokens: int = 1_000
    reply_kept_tokens: int = 1_000
    tool_time_s: tuple[float, float] = (5.0, 20.0)
    start_spread_s: float = 90.0

    def __post_init__(self) -> None:
        if self.engines < 1 or self.agents < 0 or self.storm_sessions < 0:
            raise ValueError("engines must be >= 1, agents and storm_sessions >= 0")
        if not (self.duration_s > 0 and self.time_scale > 0):
            raise ValueError("duration_s and time_scale must be > 0")
        if not all(0.0 <= f < 1.0 for f in self.storms_at):
            raise ValueError("storms_at are fractions of the duration in [0, 1)")

    def real_s(self, simulated_s: float) -> float:
        return simulated_s / self.time_scale


@dataclass(slots=True)
class Turn:
    session: str
    kind: str  # opening | medium | long | storm
    prompt_tokens: int
    started_at: float
    storm: int | None = None  # the storm's index, for a storm session's turn
    ended_at: float | None = None
    ok: bool | None = None
    request_id: str | None = None
    status: int | None = None


@dataclass(slots=True)
class ModeRun:
    """What one mode recorded (simulated seconds)."""

    mode: str
    storms: list[float]
    turns: list[Turn] = field(default_factory=list)
    ends: dict[str, dict[str, Any]] = field(default_factory=dict)  # gateway request id -> timing
    generations: list[dict[str, Any]] = field(default_factory=list)
    tokens_total: int = 0
    real_s: float = 0.0


class _Fleet:
    """The agents and the storm sessions of one mode, all talking to one gateway."""

    def __init__(self, config: StormConfig, url: str, http: aiohttp.ClientSession, now: Any) -> None:
        self.config, self.url, self.http, self.now = config, url, http, now
        self.turns: list[Turn] = []

    async def agent(self, index: int) -> None:
        config = self.config
        start = random.Random(f"{config.seed}/start/{index}").uniform(0.0, config.start_spread_s)
        await asyncio.sleep(config.real_s(start))
        for number in range(1_000_000):
            await self.session(f"a{index:02d}-s{number}", storm=None)

    async def session(self, name: str, storm: int | None) -> None:
        config = self.config
        rng = random.Random(f"{config.seed}/{name}")
        history = _token_ids(rng, rng.randint(*config.history_tokens))
        if storm is not None:
            plan = [("storm", rng.randint(*config.storm_tokens), 0.0)]
        else:
            plan = [("opening", rng.randint(*config.opening_tokens), rng.uniform(*config.tool_time_s))]
            for _ in range(config.turns_per_session - 1):
                kind = "long" if rng.random() < config.long_share else "medium"
                span = config.long_tokens if kind == "long" else config.medium_tokens
                plan.append((kind, rng.randint(*span), rng.uniform(*config.tool_time_s)))
        for kind, max_tokens, tool_s in plan:
            turn = Turn(
                session=name, kind=kind, prompt_tokens=len(history), started_at=self.now(), storm=storm
            )
            self.turns.append(turn)
            output = await self.call(turn, history, max_tokens)
            if output is None:
                return  # a failed turn ends the session
            history = history + output[: config.reply_kept_tokens] + _token_ids(rng, config.tool_tokens)
            await asyncio.sleep(config.real_s(tool_s))

    async def call(self, turn: Turn, history: list[int], max_tokens: int) -> list[int] | None:
        body = {"input_ids": history, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
        try:
            async with self.http.post(
                f"{self.url}/generate", data=orjson.dumps(body), headers={"X-Session-Id": turn.session}
            ) as response:
                turn.status = response.status
                turn.request_id = response.headers.get("X-Rolloutgate-Request-Id")
                raw = await response.read()
        except aiohttp.ClientError:
            raw = b""
        turn.ended_at = self.now()
        answer = orjson.loads(raw) if turn.status == 200 and raw.strip() else None
        turn.ok = isinstance(answer, dict) and "output_ids" in answer
        return list(answer["output_ids"]) if turn.ok and isinstance(answer, dict) else None


def _token_ids(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 150_000) for _ in range(count)]


async def run_mode(config: StormConfig, mode: str) -> ModeRun:
    """Run one mode for `config.duration_s` simulated seconds and return its records."""
    real0 = time.perf_counter()
    storms = [f * config.duration_s for f in config.storms_at]
    run = ModeRun(mode=mode, storms=storms)
    async with SimCluster(
        engines=config.engines,
        api="sglang",
        profile="incident",
        time_scale=config.time_scale,
        seed=config.seed,
        record_token_times=True,
    ) as cluster:
        settings = GatewaySettings(
            host="127.0.0.1",
            port=0,
            engines=[EngineSpec(url=url, family="sglang") for url in cluster.urls],
            time_scale=config.time_scale,
            log_level="warning",
            **MODE_SETTINGS[mode],
        )
        server = GatewayServer(settings)
        url = await server.start()

        def on_end(exchange: Any, item: Any) -> None:
            timing = getattr(item, "timing", None)
            run.ends[exchange.request_id] = {} if timing is None else timing.as_dict()

        server.context.driver.on_end.append(on_end)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            fleet = _Fleet(config, url, http, cluster.clock.now)
            tasks = [asyncio.create_task(fleet.agent(i)) for i in range(config.agents)]
            tasks += [asyncio.create_task(_storm(fleet, i, at)) for i, at in enumerate(storms)]
            await asyncio.sleep(config.real_s(config.duration_s - cluster.clock.now()))
            for engine in cluster.engines:
                engine.sync()
            run.tokens_total = sum(engine.generated_tokens_total for engine in cluster.engines)
            run.generations = _generations(cluster)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            run.turns = fleet.turns
        await server.stop(grace_s=0.0)
    run.real_s = time.perf_counter() - real0
    return run


async def _storm(fleet: _Fleet, index: int, at_s: float) -> None:
    await asyncio.sleep(fleet.config.real_s(at_s - fleet.now()))
    sessions = [fleet.session(f"storm{index}-{i}", storm=index) for i in range(fleet.config.storm_sessions)]
    await asyncio.gather(*sessions)


def _generations(cluster: SimCluster) -> list[dict[str, Any]]:
    """Every generation of the run, engine side: when it got its first token and ended, its token times."""
    return [
        {
            "engine": index,
            "rid": r.rid,
            "first_token_at": r.first_token_at,
            "finished_at": r.finished_at,
            "token_times": list(r.token_times or ()),
        }
        for index, engine in enumerate(cluster.engines)
        for r in engine.requests().values()
    ]


def measure(run: ModeRun, config: StormConfig) -> dict[str, Any]:
    """The figures of one mode (benchmarks/prefill/measure.py defines them)."""
    end = config.duration_s
    generations = generations_of(run.generations, end)
    turns = [asdict(t) | {"tag": str(i), "agent": t.session} for i, t in enumerate(run.turns)]
    request_of = {str(i): t.request_id for i, t in enumerate(run.turns) if t.request_id}
    storms = [(index, at, config.storm_sessions) for index, at in enumerate(run.storms)]
    spans, latencies, warm_ttft = turn_times(turns, request_of, last_attempts(generations), storms, end)
    contention = [e.get("contention_s", 0.0) for e in run.ends.values()]
    storm_turns = [t for t in run.turns if t.ok and t.storm is not None and t.ended_at is not None]
    return {
        "mode": run.mode,
        **shared_figures(
            spans=spans,
            decode=decode_during_storms(spans, generations),
            latencies=latencies,
            warm_ttft=warm_ttft,
            tokens_per_s=run.tokens_total / end,
            contention=contention,
            completed=len(latencies),
            failed=sum(1 for t in run.turns if t.ok is False),
        ),
        "storm_turn_latency_max_s": max(
            (t.ended_at - t.started_at for t in storm_turns if t.ended_at is not None), default=math.nan
        ),
        "requests_ended": len(contention),
        "real_s": run.real_s,
    }


_PERCENTILES = {**PERCENTILES, "warm_turn_ttft_p99_s": ("warm_ttft", 99)}

ROWS: tuple[Row, ...] = (
    ("co-located decode rate during storms, mean (tok/s)", "colocated_decode_rate_mean", "{:.1f}"),
    ("  the same, all their tokens / all their time (tok/s)", "colocated_decode_rate_pooled", "{:.1f}"),
    ("total tokens per second", "tokens_per_s", "{:.1f}"),
    ("turn latency p99 (s)", "turn_latency_p99_s", "{:.0f}"),
    ("turn latency p50 (s)", "turn_latency_p50_s", "{:.0f}"),
    ("uncharged contention, all requests (s)", "uncharged_contention_s", "{:,.0f}"),
    ("turns completed / failed", None, ""),
    ("warm turns: time to first token p99 (s)", "warm_turn_ttft_p99_s", "{:.1f}"),
    ("slowest storm turn (s)", "storm_turn_latency_max_s", "{:.0f}"),
    ("storm spans: arrival to last first token (s)", "storm_span_s", "{:.0f}"),
)


def main(argv: list[str] | None = None) -> int:
    defaults = StormConfig()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefill.storm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--engines", type=int, default=defaults.engines)
    parser.add_argument("--agents", type=int, default=defaults.agents)
    parser.add_argument("--storm-sessions", type=int, default=defaults.storm_sessions)
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="simulated seconds")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument(
        "--seeds", default=str(defaults.seed), help="workload seeds, comma-separated (pooled)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="off,on (default both, one after the other)")
    parser.add_argument("--out", type=Path, default=None, help="write prefill_storm.json and .md there")
    args = parser.parse_args(argv)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # clients cut off at the end of a mode
    config = StormConfig(
        engines=args.engines,
        agents=args.agents,
        storm_sessions=args.storm_sessions,
        duration_s=args.duration,
        time_scale=args.time_scale,
    )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes {', '.join(MODES)}")
    seeds = parse_seeds(args.seeds)
    per_seed: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for seed in seeds:
        seeded = replace(config, seed=seed)
        for mode in modes:
            print(
                f"seed {seed}, mode {mode}: {config.duration_s:.0f} simulated s at x{config.time_scale:g}",
                flush=True,
            )
            per_seed[mode].append(measure(asyncio.run(run_mode(seeded, mode)), seeded))
        if len(seeds) > 1:
            print(table({m: per_seed[m][-1] for m in modes}, ROWS), flush=True)
    figures = {m: pool(per_seed[m], _PERCENTILES) for m in modes}
    text = table(figures, ROWS)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        strip = {m: [{k: v for k, v in f.items() if k != "raw"} for f in per_seed[m]] for m in modes}
        pooled = {m: {k: v for k, v in f.items() if k != "raw"} for m, f in figures.items()}
        result = {
            "config": asdict(config),
            "seeds": seeds,
            "modes": {m: MODE_SETTINGS[m] for m in modes},
            "figures": pooled,
            "per_seed": strip,
        }
        (args.out / "prefill_storm.json").write_text(json.dumps(result, indent=2, default=str))
        (args.out / "prefill_storm.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
