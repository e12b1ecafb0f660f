"""The RL shape (`make bench-rl`): miles' TITO call, the same load direct, through rolloutgate and through the
SGLang Model Gateway, in one run.

Theory of operation. miles sends non-streaming SGLang `POST /generate` calls with `input_ids` of 20K-100K
tokens, prefix-shared within a session (each turn's `input_ids` are the previous turn's plus its output ids
plus a few new ids: the tool's answer), `return_logprob: true`, `no_stop_trim`, `skip_special_tokens`,
`spaces_between_special_tokens` as in reference/miles.md, and the header `X-SMG-Routing-Key: <session>`;
its client (httpx) has no timeout. This module builds that load and runs it three times against the same
simulated engines (`rolloutgate sim --api sglang`, one process, decode at 70 tok/s whatever the batch,
time-scaled so that a 32K-token decode takes tens of seconds):

1. `direct`: the clients call the engines themselves, round-robin by session (session n on engine n mod N);
2. `rolloutgate`: `rolloutgate serve --engine ...` with its default settings, only `--time-scale` matching;
3. `sglang-router`: the SGLang Model Gateway with a policy that follows the routing key (`manual`, sticky
   sessions; 0.3.2 has no consistent hashing).

The load is a plan fixed before the first phase (`plan_load`): `concurrency` workers, each with a budget of
generated tokens, runs sessions back to back; every turn's input length, new ids and `max_new_tokens` (drawn
from 2K-32K with density ~ 1/x^2: median ~3.8K, mean ~6K, so the long tail fits the time budget) are drawn
from the seed, and the engines' output ids are deterministic in the prompt, so every phase sends exactly the
same requests, as long as none fails. Each worker's budget is in tokens rather than turns so that all workers
finish at about the same time (no long drain at lower concurrency). Every phase is bounded in turns and in
time (`phase_cap_s`, then the outstanding calls are cancelled and the phase is marked cut).

What each phase measures, over the phase (first call to last answer):
- engine output work: each engine's Prometheus counters `sim:output_bytes_total` and `sim:output_chunks_total`
  (before and after; when the simulator does not expose them yet, `/proc/<sim>/io` wchar and syscw of the
  simulator process stand in, and the report says so), per request answered;
- gateway CPU seconds (`/proc/<pid>/stat`, the process and its children) per million generated tokens, the
  tokens counted from the answers' `meta_info.completion_tokens`;
- gateway RSS, sampled every 0.25 s with the client's in-flight count and in-flight request-body bytes; at the
  sample with the most body bytes in flight, (RSS - idle RSS) / those bytes;
- turn latency (client send to full answer), p50 and p99, and the simulator's and the client's CPU, which
  say whether the simulator was the bottleneck (`limits`).

Pinning (2 CPUs): the gateway under test alone on CPU 0; the simulator and this process (the clients) on CPU 1,
in every phase, so the direct phase has the same engine placement as the gateway phases. The engines' prefix
caches are flushed between phases. Verdicts: `goals()`, pure arithmetic over the phases' summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import resource
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from rolloutgate.bench.perf.procs import (
    ManagedProcess,
    cpu_count,
    cpu_seconds,
    installed_router,
    machine_description,
    rss_bytes,
    set_log_dir,
    start_gateway,
    start_router,
    start_sim,
)
from rolloutgate.bench.perf.report import command_line
from rolloutgate.bench.perf.report import format_value as fmt
from rolloutgate.sim.tokens import DEFAULT_VOCAB_SIZE

__all__ = (
    "DEFAULT",
    "PATHS",
    "QUICK",
    "PhaseResult",
    "ShapeOptions",
    "Turn",
    "add_arguments",
    "draw_max_new",
    "goals",
    "percentile",
    "plan_load",
    "render",
    "request_body",
    "run_from_args",
    "session_prefix",
    "turn_new_ids",
)

TOKENS_PER_S = 70.0  # decode rate of one request, simulated (any batch size)
VOCAB_SIZE = DEFAULT_VOCAB_SIZE  # the simulator's accepted id range, as the benchmark starts it (Qwen's)
FIRST_ID = 3  # pad, bos, eos below
# shared by every session (a system prompt): cross-session cache hits, as in miles
SYSTEM_PREFIX_TOKENS = 1024
# direct-again: the direct phase once more, last, so the paired latency of a phase against itself shows how
# much of a gateway's paired figure is this machine's and the simulator's own turn-to-turn noise
PATHS = ("direct", "rolloutgate", "sglang-router", "direct-again")
GATEWAYS = ("rolloutgate", "sglang-router")
ROUTING_HEADER = "X-SMG-Routing-Key"
SAMPLE_EVERY_S = 0.25
# ids as shared int objects: a session's 100K-id list then costs 8 bytes per id in this process, not ~40
_POOL = list(range(VOCAB_SIZE))

# goals (issue 19 item 6)
GOAL_OUTPUT_WORK = 1.1  # engine output bytes (and chunks) per request through a gateway, over direct ...
# ... plus a small constant per request: a first-token chunk (rolloutgate's progress signal on /generate)
OUTPUT_ALLOWANCE = {"bytes": 4096.0, "chunks": 1.0}
GOAL_CPU_VS_ROUTER = 1.0  # rolloutgate CPU-s per M generated tokens over the SGLang Model Gateway's
GOAL_RSS_PER_BODY = 1.5  # (RSS at peak in flight - idle RSS) / request-body bytes in flight
GOAL_ADDED_LATENCY_PCT = 1.0  # added p50 and p99 turn latency over direct, % of the turn


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapeOptions:
    # 2 x 64 clients at time scale 3 is what this 2-CPU VM carries with the simulator below saturation
    # (~0.5 core for ~27K generated tok/s with logprobs, plus ~0.15 for the clients, on one CPU)
    engines: int = 2
    running_per_engine: int = 64  # clients per engine: concurrency = engines x running_per_engine
    engine_slots: int = 256  # --max-running-requests: above the mean so the drift of sessions never queues
    time_scale: float = 3.0
    # generated-token budget of each worker per phase (>= max_new's top, so 32K turns occur)
    tokens_per_worker: int = 33_000
    input_min: int = 20_000
    input_max: int = 100_000
    start_max: int = 90_000  # a session's first input is drawn from [input_min, start_max]
    new_ids: tuple[int, int] = (16, 512)  # ids added per turn after the previous output (tool results)
    max_new: tuple[int, int] = (2_048, 32_768)
    prefill_rate: float = 1e6  # simulated prompt tokens/s (cached prefixes are free)
    # worker w's first call waits w / concurrency of this (None: one shortest turn's simulated decode)
    ramp_s: float | None = None
    phase_cap_s: float = 220.0
    max_turns_per_worker: int = 200
    router_policy: str = "manual"
    paths: tuple[str, ...] = PATHS
    seed: int = 0

    @property
    def concurrency(self) -> int:
        return self.engines * self.running_per_engine

    @property
    def ramp(self) -> float:
        """Seconds over which the workers' first calls are spread, so completions do not come in waves."""
        if self.ramp_s is not None:
            return self.ramp_s
        return self.max_new[0] / TOKENS_PER_S / self.time_scale


DEFAULT = ShapeOptions()
QUICK = ShapeOptions(
    engines=2,
    running_per_engine=8,
    engine_slots=64,
    time_scale=50.0,
    tokens_per_worker=2_500,
    input_min=2_000,
    input_max=8_000,
    start_max=6_000,
    new_ids=(8, 64),
    max_new=(256, 2_048),
    phase_cap_s=30.0,
    max_turns_per_worker=20,
)


# ----------------------------------------------------------------------------------------------- the load


@dataclass(frozen=True, slots=True)
class Turn:
    worker: int
    index: int  # the worker's n-th turn
    session: str
    session_number: int  # global: the direct path's round-robin key
    turn_in_session: int
    input_len: int
    new_ids: int  # ids appended after the previous turn's output (0 on a session's first turn)
    max_new: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.worker, self.index)


def draw_max_new(rng: random.Random, low: int, high: int) -> int:
    """`max_new_tokens` from [low, high] with density ~ 1/x^2 (inverse CDF): skewed to the short end."""
    u = rng.random()
    return min(high, max(low, round(1.0 / (1.0 / low - u * (1.0 / low - 1.0 / high)))))


def plan_load(options: ShapeOptions) -> list[list[Turn]]:
    """Every worker's turns, fixed by the seed (module docstring). Input lengths follow from the plan alone:
    turn t+1's input is turn t's input, its `max_new` output ids (the engines never stop early here) and
    `new_ids` more; a session ends before its input would pass `input_max`, and the worker starts another."""
    low, high = options.max_new
    plan: list[list[Turn]] = []
    concurrency = options.concurrency
    for worker in range(concurrency):
        rng = random.Random(f"rl-shape:{options.seed}:{worker}")
        turns: list[Turn] = []
        remaining = options.tokens_per_worker
        sessions = 0
        length = 0
        in_session = 0
        previous_max_new = 0
        session_number = -1
        while remaining >= low and len(turns) < options.max_turns_per_worker:
            max_new = min(draw_max_new(rng, low, high), remaining)
            new = rng.randint(*options.new_ids) if session_number >= 0 else 0
            following = length + previous_max_new + new
            if session_number < 0 or following > options.input_max:
                session_number = sessions * concurrency + worker
                sessions += 1
                length = rng.randint(options.input_min, options.start_max)
                in_session, new = 0, 0
            else:
                length, in_session = following, in_session + 1
            turns.append(
                Turn(
                    worker=worker,
                    index=len(turns),
                    session=f"rls-{options.seed}-{session_number}",
                    session_number=session_number,
                    turn_in_session=in_session,
                    input_len=length,
                    new_ids=new,
                    max_new=max_new,
                )
            )
            remaining -= max_new
            previous_max_new = max_new
        plan.append(turns)
    return plan


def _ids(offset: int, stride: int, count: int, start: int = 0) -> list[int]:
    span, pool = VOCAB_SIZE - FIRST_ID, _POOL
    return [pool[FIRST_ID + (offset + i * stride) % span] for i in range(start, start + count)]


def session_prefix(session_number: int, length: int) -> list[int]:
    """A session's first `input_ids`: the shared system prefix, then ids of its own."""
    shared = _ids(7, 7919, min(length, SYSTEM_PREFIX_TOKENS))
    own = max(0, length - SYSTEM_PREFIX_TOKENS)
    return shared + _ids(104_729 * (session_number + 1), 2 * (session_number % 5000) + 3, own)


def turn_new_ids(turn: Turn) -> list[int]:
    """The ids a turn appends after the previous output (the tool's answer), fixed by the turn."""
    return _ids(31 * turn.session_number + 977 * turn.turn_in_session, 65_537, turn.new_ids)


def request_body(input_ids: list[int], max_new: int) -> dict[str, Any]:
    """miles' TITO `/generate` body (reference/miles.md; `generate_hub` sampling params)."""
    return {
        "input_ids": input_ids,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": max_new,
            "stop": None,
            "stop_token_ids": None,
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        },
        "return_logprob": True,
    }


def plan_summary(plan: list[list[Turn]]) -> dict[str, Any]:
    turns = [t for worker in plan for t in worker]
    inputs = sorted(t.input_len for t in turns)
    outputs = sorted(t.max_new for t in turns)
    return {
        "workers": len(plan),
        "turns": len(turns),
        "sessions": len({t.session for t in turns}),
        "generated_tokens": sum(outputs),
        "input_len": {"min": inputs[0], "p50": percentile(inputs, 50), "max": inputs[-1]} if turns else {},
        "max_new": {
            "min": outputs[0],
            "p50": percentile(outputs, 50),
            "mean": sum(outputs) / len(outputs),
            "p99": percentile(outputs, 99),
            "max": outputs[-1],
        }
        if turns
        else {},
    }


# ----------------------------------------------------------------------------------------------- arithmetic


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of `values` (q in [0, 100]); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    if math.isnan(numerator) or math.isnan(denominator):
        return None
    return numerator / denominator


def added_pct(value: float | None, reference: float | None) -> float | None:
    """`value` over `reference`, in percent of the reference (+1.0 = 1% longer)."""
    r = ratio(value, reference)
    return None if r is None else 100.0 * (r - 1.0)


def verdict(value: float | None, goal: float) -> str:
    """`met` when `value` <= `goal` (every goal here is an upper bound)."""
    if value is None or math.isnan(value):
        return "not measured"
    return "met" if value <= goal else "NOT met"


# ----------------------------------------------------------------------------------------------- one phase


@dataclass(slots=True)
class TurnResult:
    worker: int
    index: int
    status: int  # HTTP status; 0: transport error; -1: cut (phase cap); -2: skipped (session failed earlier)
    latency_s: float = math.nan
    body_bytes: int = 0
    response_bytes: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Sample:
    t: float
    in_flight: int
    in_flight_bytes: int
    rss: int


@dataclass(slots=True)
class PhaseResult:
    name: str
    wall_s: float
    turns_planned: int
    results: list[TurnResult]
    cut: bool
    engine: dict[str, float]  # counter deltas summed over the engines (bytes, chunks, tokens, requests, ...)
    engine_requests: list[float]  # requests per engine (sglang:num_requests_total deltas)
    work_source: str  # "sim:output_*_total" or the fallback's name
    gateway_cpu_s: float | None
    sim_cpu_s: float
    client_cpu_s: float
    idle_rss: int | None
    samples: list[Sample] = field(default_factory=list)
    ideal_s: dict[tuple[int, int], float] = field(default_factory=dict)
    cpu_busy_s: dict[int, float] = field(default_factory=dict)  # each CPU's busy seconds over the phase
    server_cpus: tuple[int, ...] = ()
    client_cpus: tuple[int, ...] = ()

    # -- derived

    @property
    def ok(self) -> list[TurnResult]:
        return [r for r in self.results if r.status == 200]

    @property
    def generated_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    def count(self, status: int) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def failures(self) -> int:
        return sum(1 for r in self.results if r.status not in (200, -1, -2))

    @property
    def latencies(self) -> dict[tuple[int, int], float]:
        return {(r.worker, r.index): r.latency_s for r in self.ok}

    def p(self, q: float) -> float:
        return percentile(list(self.latencies.values()), q)

    @property
    def bytes_per_request(self) -> float | None:
        return ratio(self.engine.get("output_bytes"), len(self.ok))

    @property
    def chunks_per_request(self) -> float | None:
        return ratio(self.engine.get("output_chunks"), len(self.ok))

    @property
    def bytes_per_token(self) -> float | None:
        return ratio(self.engine.get("output_bytes"), self.engine.get("generated_tokens"))

    @property
    def cpu_per_million_tokens(self) -> float | None:
        if self.gateway_cpu_s is None:
            return None
        return ratio(1e6 * self.gateway_cpu_s, self.generated_tokens)

    @property
    def peak(self) -> Sample | None:
        """The sample with the most request-body bytes in flight."""
        return max(self.samples, key=lambda s: (s.in_flight_bytes, s.t)) if self.samples else None

    @property
    def rss_per_body(self) -> float | None:
        peak = self.peak
        if peak is None or self.idle_rss is None or peak.rss <= 0:
            return None
        return ratio(peak.rss - self.idle_rss, peak.in_flight_bytes)

    @property
    def max_rss(self) -> int | None:
        values = [s.rss for s in self.samples if s.rss > 0]
        return max(values) if values else None

    @property
    def stretch_p50(self) -> float:
        """Median of latency / ideal (the simulated decode of the turn in real seconds): 1.0 = no lag."""
        values = [lat / self.ideal_s[k] for k, lat in self.latencies.items() if self.ideal_s.get(k)]
        return percentile(values, 50)

    @property
    def cache_hit(self) -> float | None:
        return ratio(self.engine.get("cached_tokens"), self.engine.get("prompt_tokens"))

    def neighbours_cores(self) -> dict[str, float | None]:
        """CPU time on our CPUs that none of this benchmark's processes used (the shared VM's neighbours),
        in cores: the client CPU's busy time less the simulator's and the clients', the server CPU's less the
        gateway's (None without pinning)."""
        if not self.wall_s or not self.client_cpus:
            return {"client_cpu": None, "server_cpu": None}
        client = (
            sum(self.cpu_busy_s.get(c, 0.0) for c in self.client_cpus) - self.sim_cpu_s - self.client_cpu_s
        )
        server = sum(self.cpu_busy_s.get(c, 0.0) for c in self.server_cpus) - (self.gateway_cpu_s or 0.0)
        return {"client_cpu": max(0.0, client) / self.wall_s, "server_cpu": max(0.0, server) / self.wall_s}

    def summary(self) -> dict[str, Any]:
        peak = self.peak
        return {
            "name": self.name,
            "wall_s": round(self.wall_s, 2),
            "turns_planned": self.turns_planned,
            "turns_ok": len(self.ok),
            "failed": self.failures,
            "cut": self.count(-1),
            "skipped": self.count(-2),
            "phase_cut_at_cap": self.cut,
            "errors": sorted({r.error for r in self.results if r.error})[:10],
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": round(self.generated_tokens / self.wall_s) if self.wall_s else None,
            "engine_counters": self.engine,
            "engine_requests": self.engine_requests,
            "output_work_source": self.work_source,
            "output_bytes_per_request": self.bytes_per_request,
            "output_chunks_per_request": self.chunks_per_request,
            "output_bytes_per_token": self.bytes_per_token,
            "cache_hit": self.cache_hit,
            "gateway_cpu_s": self.gateway_cpu_s,
            "gateway_cpu_s_per_million_tokens": self.cpu_per_million_tokens,
            "gateway_cores": None if self.gateway_cpu_s is None else self.gateway_cpu_s / self.wall_s,
            "sim_cores": self.sim_cpu_s / self.wall_s if self.wall_s else None,
            "client_cores": self.client_cpu_s / self.wall_s if self.wall_s else None,
            "neighbours_cores": self.neighbours_cores(),
            "idle_rss_mb": None if self.idle_rss is None else self.idle_rss / 1e6,
            "max_rss_mb": None if self.max_rss is None else self.max_rss / 1e6,
            "peak": None if peak is None else asdict(peak),
            "rss_per_body_byte": self.rss_per_body,
            "latency_p50_s": self.p(50),
            "latency_p99_s": self.p(99),
            "stretch_p50": self.stretch_p50,
            "request_body_mb_mean": sum(r.body_bytes for r in self.ok) / len(self.ok) / 1e6
            if self.ok
            else None,
            "response_mb_mean": sum(r.response_bytes for r in self.ok) / len(self.ok) / 1e6
            if self.ok
            else None,
            "samples": [[round(s.t, 2), s.in_flight, s.in_flight_bytes, s.rss] for s in self.samples],
            "turns": [
                [r.worker, r.index, r.status, None if math.isnan(r.latency_s) else round(r.latency_s, 4)]
                for r in self.results
            ],
        }


class _InFlight:
    """What the clients have sent and not yet read back (read by the sampler thread)."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0

    def add(self, size: int) -> None:
        self.count += 1
        self.bytes += size

    def remove(self, size: int) -> None:
        self.count -= 1
        self.bytes -= size


def _output_ids(answer: dict[str, Any]) -> list[int]:
    """The answer's output ids as miles reads them (`meta_info.output_token_logprobs`: [logprob, id, _])."""
    meta = answer.get("meta_info") or {}
    logprobs = meta.get("output_token_logprobs")
    pool = _POOL
    if isinstance(logprobs, list) and (logprobs or not answer.get("output_ids")):
        return [pool[entry[1]] for entry in logprobs]
    return [pool[t] for t in answer.get("output_ids") or []]


async def _drive(
    plan: list[list[Turn]],
    url_of: Callable[[Turn], str],
    *,
    cap_s: float,
    tracker: _InFlight,
    ramp_s: float = 0.0,
) -> tuple[list[TurnResult], bool, float]:
    """Run every worker's turns at once (closed loop, one call in flight per worker). Returns the results in
    plan order, whether the phase hit its cap, and its wall time (first call to last answer)."""
    results: dict[tuple[int, int], TurnResult] = {}
    connector = aiohttp.TCPConnector(limit=len(plan) + 8, limit_per_host=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_read=None, sock_connect=None)
    began = time.perf_counter()

    async def worker(session: aiohttp.ClientSession, turns: list[Turn], delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        ids: list[int] | None = None
        output: list[int] = []
        for turn in turns:
            if turn.turn_in_session == 0:
                ids, output = session_prefix(turn.session_number, turn.input_len), []
            elif ids is None:
                results[turn.key] = TurnResult(turn.worker, turn.index, -2)
                continue
            else:
                ids.extend(output)
                ids.extend(turn_new_ids(turn))
            body = orjson.dumps(request_body(ids, turn.max_new))
            result = TurnResult(turn.worker, turn.index, -1, body_bytes=len(body))
            results[turn.key] = result
            headers = {"Content-Type": "application/json", ROUTING_HEADER: turn.session}
            tracker.add(len(body))
            sent = time.perf_counter()
            try:
                async with session.post(url_of(turn), data=body, headers=headers) as response:
                    raw = await response.read()
                    status = response.status
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a transport error: the session cannot go on
                result.status, result.error = 0, f"{type(exc).__name__}: {exc}"[:200]
                ids = None
                continue
            finally:
                tracker.remove(len(body))
            result.latency_s = time.perf_counter() - sent
            result.status, result.response_bytes = status, len(raw)
            if status != 200:
                result.error = f"HTTP {status}: {raw[:160].decode(errors='replace')}"
                ids = None
                continue
            try:
                answer = orjson.loads(raw)
                meta = answer.get("meta_info") or {}
                output = _output_ids(answer)
            except (orjson.JSONDecodeError, AttributeError, TypeError, IndexError, KeyError) as exc:
                result.status, result.error = 0, f"unreadable answer: {exc}"[:200]
                ids = None
                continue
            result.completion_tokens = int(meta.get("completion_tokens") or len(output))
            result.cached_tokens = int(meta.get("cached_tokens") or 0)
            result.prompt_tokens = int(meta.get("prompt_tokens") or 0)
            if len(output) != turn.max_new:  # the plan's lengths no longer hold for this session
                result.error = f"{len(output)} output ids for max_new_tokens {turn.max_new}"

    cut = False
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.ensure_future(worker(session, turns, ramp_s * w / len(plan)))
            for w, turns in enumerate(plan)
        ]
        done, pending = await asyncio.wait(tasks, timeout=cap_s)
        if pending:
            cut = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    wall = time.perf_counter() - began
    ordered = []
    for turns in plan:
        for turn in turns:
            ordered.append(results.get(turn.key) or TurnResult(turn.worker, turn.index, -1))
    return ordered, cut, wall


# ----------------------------------------------------------------------------------------------- engines


_COUNTERS = {
    "output_bytes": "sim:output_bytes_total",
    "output_chunks": "sim:output_chunks_total",
    "output_busy_s": "sim:output_busy_seconds_total",  # simulated seconds the engine's output path worked
    "generated_tokens": "sglang:generation_tokens_total",
    "requests": "sglang:num_requests_total",
    "prompt_tokens": "sglang:prompt_tokens_total",
    "cached_tokens": "sglang:cached_tokens_total",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _get(url: str, timeout_s: float = 30.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data: bytes = response.read()
        return data


_STATE_FALLBACK = {"output_bytes": "output_bytes_total", "output_chunks": "output_chunks_total"}


def _engine_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each engine's counters from its /metrics; where the simulator has no `sim:output_*` counters, the
    same figures from /sim/state when it has them (marked `from_state`)."""
    per_engine = []
    for url in urls:
        metrics = parse_prometheus(_get(url + "/metrics").decode())
        counters = {key: metrics[name] for key, name in _COUNTERS.items() if name in metrics}
        if "output_bytes" not in counters:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(_get(url + "/sim/state?requests=0"))
                for key, name in _STATE_FALLBACK.items():
                    if isinstance(state.get(name), int | float):
                        counters[key] = float(state[name])
                        counters["from_state"] = 1.0
        per_engine.append(counters)
    return per_engine


def cpu_busy_s(cpus: Iterable[int] | None = None) -> dict[int, float]:
    """Busy seconds so far of each CPU (/proc/stat: all but idle and iowait), to tell the neighbours' share."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        for line in f:
            head, *values = line.split()
            if not head.startswith("cpu") or head == "cpu":
                continue
            index = int(head[3:])
            if cpus is not None and index not in cpus:
                continue
            numbers = [int(v) for v in values[:8]]
            out[index] = (sum(numbers) - numbers[3] - numbers[4]) / tick
    return out


def _proc_io(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def _wait_idle(urls: list[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0
        for url in urls:
            with contextlib.suppress(OSError, ValueError, KeyError):
                state = json.loads(_get(url + "/sim/state?requests=0"))
                busy += int(state["running"]) + int(state["waiting"])
        if busy == 0:
            return True
        time.sleep(0.25)
    return False


def _flush(urls: list[str]) -> None:
    for url in urls:
        request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def engine_flags(options: ShapeOptions) -> list[str]:
    """The simulated engines: decode 70 tok/s at any batch, a prefill that is cheap (cached prefixes free),
    a whole prompt per prefill batch, KV and context for every client's 100K + 32K tokens."""
    return [
        "--max-running-requests",
        str(options.engine_slots),
        "--decode-base-ms",
        f"{1000 / TOKENS_PER_S:.4f}",
        "--decode-per-request-ms",
        "0",
        "--decode-per-ktoken-ms",
        "0",
        "--prefill-rate",
        f"{options.prefill_rate:g}",
        "--chunked-prefill-size",
        str(1 << 17),
        "--kv-capacity",
        str(1 << 26),
        "--context-len",
        str(1 << 18),
        "--time-scale",
        f"{options.time_scale:g}",
    ]


def _warm(url: str, count: int = 4) -> None:
    """A few tiny calls, so a gateway's idle RSS is taken after its first-request imports and buffers."""
    body = orjson.dumps(request_body(list(range(FIRST_ID, FIRST_ID + 32)), 4))
    for i in range(count):
        request = urllib.request.Request(
            url + "/generate",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", ROUTING_HEADER: f"warm-{i}"},
        )
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=60) as response:
            response.read()


def _runner() -> asyncio.Runner:
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.Runner()


def run_phase(
    name: str,
    plan: list[list[Turn]],
    options: ShapeOptions,
    *,
    sim: ManagedProcess,
    gateway: ManagedProcess | None,
    server_cpu: str | None = None,
    client_cpu: str | None = None,
    log: Callable[[str], None] = print,
) -> PhaseResult:
    engine_urls = sim.extra_urls
    if gateway is None:
        _warm(engine_urls[0])

        def url_of(turn: Turn) -> str:
            return engine_urls[turn.session_number % len(engine_urls)] + "/generate"
    else:
        _warm(gateway.url)
        time.sleep(1.0)
        gateway_url = gateway.url + "/generate"

        def url_of(turn: Turn) -> str:
            return gateway_url

    _wait_idle(engine_urls, 30)
    _flush(engine_urls)
    idle_rss = rss_bytes(gateway.pid) if gateway is not None else None
    before = _engine_counters(engine_urls)
    io_before = _proc_io(sim.pid)
    sim_before = cpu_seconds(sim.pid)
    gw_before = cpu_seconds(gateway.pid) if gateway is not None else None
    client_before = resource.getrusage(resource.RUSAGE_SELF)
    busy_before = cpu_busy_s()

    tracker = _InFlight()
    samples: list[Sample] = []
    stop = threading.Event()
    began = time.perf_counter()

    def sample() -> None:
        while not stop.wait(SAMPLE_EVERY_S):
            rss = rss_bytes(gateway.pid) if gateway is not None else 0
            samples.append(Sample(time.perf_counter() - began, tracker.count, tracker.bytes, rss))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with _pinned_to(client_cpu), _runner() as runner:
            results, cut, wall = runner.run(
                _drive(plan, url_of, cap_s=options.phase_cap_s, tracker=tracker, ramp_s=options.ramp)
            )
    finally:
        stop.set()
        sampler.join(timeout=5)
    client_after = resource.getrusage(resource.RUSAGE_SELF)
    busy_after = cpu_busy_s()
    gw_after = cpu_seconds(gateway.pid) if gateway is not None else None
    sim_after = cpu_seconds(sim.pid)
    if cut:
        log(f"  {name}: cut at {options.phase_cap_s:g} s; waiting for the engines to finish what they hold")
    # a cut phase leaves generations the gateway aborts; count their work too, within bounds
    _wait_idle(engine_urls, 60 if cut else 10)
    after = _engine_counters(engine_urls)
    io_after = _proc_io(sim.pid)

    engine: dict[str, float] = {}
    for key in _COUNTERS:
        if all(key in b and key in a for b, a in zip(before, after, strict=True)):
            engine[key] = sum(a[key] - b[key] for b, a in zip(before, after, strict=True))
    from_state = any("from_state" in a for a in after)
    if "output_bytes" in engine and "output_chunks" in engine and not from_state:
        source = "sim:output_bytes_total, sim:output_chunks_total (the engines' /metrics)"
    elif "output_bytes" in engine and "output_chunks" in engine:
        source = (
            "FALLBACK: /sim/state output_bytes_total and output_chunks_total (no sim:output_* in /metrics)"
        )
    else:
        engine["output_bytes"] = float(io_after.get("wchar", 0) - io_before.get("wchar", 0))
        engine["output_chunks"] = float(io_after.get("syscw", 0) - io_before.get("syscw", 0))
        source = (
            "FALLBACK: /proc/<sim>/io wchar and syscw of the simulator process (sim:output_bytes_total and "
            "sim:output_chunks_total are not exposed by this simulator); includes response headers and "
            "the answers to any gateway's probes"
        )
    requests_per_engine = [
        a.get("requests", 0) - b.get("requests", 0) for b, a in zip(before, after, strict=True)
    ]
    client_cpu_used = (client_after.ru_utime - client_before.ru_utime) + (
        client_after.ru_stime - client_before.ru_stime
    )
    ideal = {t.key: t.max_new / TOKENS_PER_S / options.time_scale for turns in plan for t in turns}
    return PhaseResult(
        name=name,
        wall_s=wall,
        turns_planned=sum(len(t) for t in plan),
        results=results,
        cut=cut,
        engine=engine,
        engine_requests=requests_per_engine,
        work_source=source,
        gateway_cpu_s=None if gw_before is None or gw_after is None else gw_after - gw_before,
        sim_cpu_s=sim_after - sim_before,
        client_cpu_s=client_cpu_used,
        idle_rss=idle_rss,
        samples=samples,
        ideal_s=ideal,
        cpu_busy_s={c: busy_after[c] - busy_before.get(c, 0.0) for c in busy_after},
        server_cpus=_cpu_list(server_cpu),
        client_cpus=_cpu_list(client_cpu),
    )


def _cpu_list(cpus: str | None) -> tuple[int, ...]:
    return () if cpus is None else tuple(int(c) for c in cpus.split(",") if c.strip())


@contextlib.contextmanager
def _pinned_to(cpus: str | None) -> Iterator[None]:
    """Run this process (the clients) on `cpus` for a while; the servers are started outside, pinned by
    taskset (pin_prefix reads this process's affinity, so it must not be narrowed when they start)."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(_cpu_list(cpus)))
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, previous)


# ----------------------------------------------------------------------------------------------- verdicts


def goals(phases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal's measured value and verdict, from the phases' summaries (`PhaseResult.summary()`)."""
    rows: list[dict[str, Any]] = []
    direct = phases.get("direct")
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None or direct is None:
            continue
        for what, key, token_key in (
            ("bytes", "output_bytes_per_request", "output_bytes_per_token"),
            ("chunks", "output_chunks_per_request", None),
        ):
            value = ratio(phase.get(key), direct.get(key))
            allowance = OUTPUT_ALLOWANCE[what]
            mine, theirs = phase.get(key), direct.get(key)
            # the goal: at most 1.1x the direct call's plus the allowance, per request
            within = (
                None if mine is None or theirs is None else mine / (GOAL_OUTPUT_WORK * theirs + allowance)
            )
            note = (
                f" ({mine:,.1f} vs {theirs:,.1f} per request)"
                if mine is not None and theirs is not None
                else ""
            )
            if (phase.get("phase_cut_at_cap") or direct.get("phase_cut_at_cap")) and token_key is not None:
                # a cut phase's counters hold partial generations: per generated token is the fair measure
                value = within = ratio(phase.get(token_key), direct.get(token_key))
                within = None if within is None else within / GOAL_OUTPUT_WORK
                note = " (a phase was cut: per generated token)"
            rows.append(
                {
                    "goal": f"engine output {what} per request via {name} <= {GOAL_OUTPUT_WORK:g}x direct "
                    f"+ {allowance:g}",
                    "value": value,
                    "measured": "-" if value is None else f"x{value:,.2f}{note}",
                    "verdict": verdict(within, 1.0),
                }
            )
    mine, router = phases.get("rolloutgate"), phases.get("sglang-router")
    if mine is not None and router is not None:
        a = mine.get("gateway_cpu_s_per_million_tokens")
        b = router.get("gateway_cpu_s_per_million_tokens")
        value = ratio(a, b)
        rows.append(
            {
                "goal": f"rolloutgate CPU-s per M generated tokens over the SGLang Model Gateway's <= {GOAL_CPU_VS_ROUTER:g}",
                "value": value,
                "measured": "-"
                if value is None
                else f"x{value:,.2f} ({a:,.2f} vs {b:,.2f} CPU-s per M tokens)",
                "verdict": verdict(value, GOAL_CPU_VS_ROUTER),
            }
        )
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None:
            continue
        value = phase.get("rss_per_body_byte")
        peak = phase.get("peak") or {}
        rows.append(
            {
                "goal": f"{name} (RSS at peak in flight - idle) / in-flight request bodies <= {GOAL_RSS_PER_BODY:g}",
                "value": value,
                "measured": "-"
                if value is None
                else f"{value:,.2f} ({peak.get('in_flight', 0)} in flight, {peak.get('in_flight_bytes', 0) / 1e6:,.1f} MB of bodies)",
                "verdict": verdict(value, GOAL_RSS_PER_BODY),
            }
        )
    for name in GATEWAYS:
        phase = phases.get(name)
        if phase is None or direct is None:
            continue
        cut = bool(phase.get("phase_cut_at_cap") or direct.get("phase_cut_at_cap"))
        for q in (50, 99):
            # p50: paired, each turn against the same turn sent directly (the same prompt, length and session),
            # so the other processes' share of this machine's CPU moves both sides of each pair alike. p99: the
            # phases' own p99 against each other; the p99 of the paired per-turn figures is the tail of the
            # turn-to-turn noise instead (the direct phase run again shows it: its noise-floor rows)
            paired = paired_added_pct(phase, direct, q)
            unpaired = added_pct(phase.get(f"latency_p{q}_s"), direct.get(f"latency_p{q}_s"))
            value = paired if q == 50 else unpaired
            if q == 50:
                detail = f"the phases' p50: {phase['latency_p50_s']:.2f} s vs {direct['latency_p50_s']:.2f} s, {unpaired:+.2f}%"
            else:
                detail = f"{phase['latency_p99_s']:.2f} s vs {direct['latency_p99_s']:.2f} s; paired per turn {paired:+.2f}%"
            rows.append(
                {
                    "goal": f"added turn latency via {name} over direct, p{q} of the turns"
                    + (" (paired)" if q == 50 else " (the phases' p99)")
                    + f", <= {GOAL_ADDED_LATENCY_PCT:g}% of the turn",
                    "value": value,
                    "measured": "-"
                    if value is None or paired is None or unpaired is None
                    else f"{value:+.2f}% ({detail})"
                    + (" (a phase was cut: over the turns each answered)" if cut else ""),
                    "verdict": verdict(value, GOAL_ADDED_LATENCY_PCT),
                }
            )
    again = phases.get("direct-again")
    for q in (50, 99):
        value = None if again is None or direct is None else paired_added_pct(again, direct, q)
        if value is not None:
            rows.append(
                {
                    "goal": f"the noise floor: direct again over direct, p{q} of the turns (no goal)",
                    "value": value,
                    "measured": f"{value:+.2f}%",
                    "verdict": "reference",
                }
            )
    return rows


def paired_added_pct(phase: dict[str, Any], direct: dict[str, Any], q: float = 50) -> float | None:
    """The q-th percentile over the turns answered in both phases of each turn's added latency, % of its
    latency sent directly."""
    mine = {(w, i): lat for w, i, status, lat in phase["turns"] if status == 200 and lat}
    theirs = {(w, i): lat for w, i, status, lat in direct["turns"] if status == 200 and lat}
    values = [100.0 * (mine[k] / theirs[k] - 1.0) for k in mine.keys() & theirs.keys()]
    return percentile(values, q) if values else None


def limits(result: dict[str, Any]) -> list[str]:
    """What bounded this run: the simulator's and the client's CPU, the decode lag, cut phases."""
    options = result["options"]
    lines = []
    for name, phase in result["phases"].items():
        sim, client, stretch = phase["sim_cores"], phase["client_cores"], phase["stretch_p50"]
        flags = []
        if sim is not None and sim >= 0.85:
            flags.append("the simulator's CPU is saturated: it is the bottleneck")
        if stretch is not None and not math.isnan(stretch) and stretch > 1.05:
            flags.append(f"turns took x{stretch:.2f} their simulated decode (median)")
        if phase["phase_cut_at_cap"]:
            flags.append(f"cut at the {options['phase_cap_s']:g} s cap")
        neighbours = phase.get("neighbours_cores") or {}
        if (neighbours.get("client_cpu") or 0) >= 0.15 or (neighbours.get("server_cpu") or 0) >= 0.15:
            flags.append(
                f"other processes on the shared VM took {neighbours.get('client_cpu') or 0:.2f} cores of the "
                f"simulator's CPU and {neighbours.get('server_cpu') or 0:.2f} of the gateway's"
            )
        busy = phase["engine_counters"].get("output_busy_s")
        simulated_s = phase["wall_s"] * options["time_scale"] * options["engines"]
        if busy is not None and simulated_s > 0:
            share = busy / simulated_s
            note = f"the engines' output path (tokenizer manager) busy {100 * share:.1f}% of the time"
            if share >= 0.01:
                flags.append(note + ("; it is the bottleneck" if share >= 0.85 else ""))
        gateway = "" if phase["gateway_cores"] is None else f", gateway {phase['gateway_cores']:.2f} cores"
        lines.append(
            f"{name}: simulator {sim:.2f} cores (CPU 1, shared with the clients: {client:.2f} cores){gateway}; "
            f"median turn x{stretch:.3f} its simulated decode" + (f"; {'; '.join(flags)}" if flags else "")
        )
    return lines


# ----------------------------------------------------------------------------------------------- report


def render(result: dict[str, Any]) -> str:
    options, plan = result["options"], result["plan"]
    meta = result["meta"]
    lines = [
        f"RL shape, {meta['started']} ({meta.get('elapsed_s', 0):.0f} s): `{meta['command']}` on {meta['code']}",
        "",
        f"Load: {plan['workers']} non-streaming clients (aiohttp, no timeout), {options['engines']} simulated SGLang "
        f"engines x {options['running_per_engine']} running ({options['engine_slots']} slots each), "
        f"decode {TOKENS_PER_S:g} tok/s per request, time scale {options['time_scale']:g} "
        f"(a 32K-token decode = {32768 / TOKENS_PER_S / options['time_scale']:.0f} s real); "
        f"{plan['turns']:,} turns in {plan['sessions']:,} sessions, input_ids {plan['input_len']['min']:,}-"
        f"{plan['input_len']['max']:,} (p50 {plan['input_len']['p50']:,.0f}), max_new_tokens "
        f"{plan['max_new']['min']:,}-{plan['max_new']['max']:,} (p50 {plan['max_new']['p50']:,.0f}, mean "
        f"{plan['max_new']['mean']:,.0f}, density ~1/x^2), {plan['generated_tokens']:,} tokens per phase; "
        f"target {options['concurrency'] * TOKENS_PER_S * options['time_scale']:,.0f} generated tok/s. "
        f"SGLang Model Gateway policy: {options['router_policy']}.",
        "",
        "| goal | measured | verdict |",
        "| --- | --- | --- |",
    ]
    for row in result["goals"]:
        lines.append(f"| {row['goal']} | {row['measured']} | {row['verdict']} |")
    lines += [
        "",
        "| path | turns ok | failed | cut | wall s | gen tok/s | bytes/req | chunks/req | bytes/tok | cache hit "
        "| CPU-s/M tok | idle RSS MB | max RSS MB | peak in flight | bodies MB | RSS/body | p50 s | p99 s "
        "| paired added p50 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | ---: |",
    ]
    direct = result["phases"].get("direct")
    for name, phase in result["phases"].items():
        peak = phase["peak"] or {}
        paired = None if direct is None or name == "direct" else paired_added_pct(phase, direct)
        hit = phase["cache_hit"]
        lines.append(
            f"| {name} | {phase['turns_ok']:,} / {phase['turns_planned']:,} | {phase['failed']:,} | "
            f"{phase['cut'] + phase['skipped']:,} | {phase['wall_s']:.1f} | {fmt(phase['generated_tokens_per_s'])} "
            f"| {fmt(phase['output_bytes_per_request'], 0)} | {fmt(phase['output_chunks_per_request'], 1)} "
            f"| {fmt(phase['output_bytes_per_token'], 1)} | {'-' if hit is None else f'{100 * hit:.1f}%'} "
            f"| {fmt(phase['gateway_cpu_s_per_million_tokens'])} | {fmt(phase['idle_rss_mb'], 0)} "
            f"| {fmt(phase['max_rss_mb'], 0)} | {fmt(peak.get('in_flight'))} "
            f"| {fmt(peak.get('in_flight_bytes', 0) / 1e6 if peak else None, 1)} "
            f"| {fmt(phase['rss_per_body_byte'])} | {fmt(phase['latency_p50_s'])} "
            f"| {fmt(phase['latency_p99_s'])} | {'-' if paired is None else f'{paired:+.2f}%'} |"
        )
    sources = {phase["output_work_source"] for phase in result["phases"].values()}
    lines += ["", "Engine output work from: " + "; ".join(sorted(sources)) + "."]
    lines += ["", "What limited the run:"] + [f"- {line}" for line in result["limits"]]
    errors = {name: phase["errors"] for name, phase in result["phases"].items() if phase["errors"]}
    for name, sample in errors.items():
        lines.append(f"- {name}: errors seen: {'; '.join(sample[:3])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- the run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rl-shape (`--only rl-shape`, make bench-rl)")
    add = group.add_argument
    add("--rl-shape-engines", type=int, help=f"simulated engines (default {DEFAULT.engines})")
    add("--rl-shape-running", type=int, help=f"clients per engine (default {DEFAULT.running_per_engine})")
    add("--rl-shape-time-scale", type=float, help=f"simulated s per real s (default {DEFAULT.time_scale:g})")
    add(
        "--rl-shape-tokens-per-worker",
        type=int,
        help=f"generated tokens each client asks for per phase (default {DEFAULT.tokens_per_worker})",
    )
    add("--rl-shape-cap", type=float, help=f"seconds per phase at most (default {DEFAULT.phase_cap_s:g})")
    add(
        "--rl-shape-router-policy",
        choices=("manual", "cache_aware", "round_robin"),
        help="the SGLang Model Gateway's policy (default manual: sticky on X-SMG-Routing-Key)",
    )
    add("--rl-shape-paths", help=f"comma-separated subset of {','.join(PATHS)} (direct is always run)")
    add("--rl-shape-seed", type=int, help="the load's seed (default 0)")


def options_from_args(args: argparse.Namespace) -> ShapeOptions:
    options = QUICK if getattr(args, "quick", False) else DEFAULT
    changes: dict[str, Any] = {}
    for attr, name in (
        ("rl_shape_engines", "engines"),
        ("rl_shape_running", "running_per_engine"),
        ("rl_shape_time_scale", "time_scale"),
        ("rl_shape_tokens_per_worker", "tokens_per_worker"),
        ("rl_shape_cap", "phase_cap_s"),
        ("rl_shape_router_policy", "router_policy"),
        ("rl_shape_seed", "seed"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            changes[name] = value
    paths = getattr(args, "rl_shape_paths", None)
    if paths:
        chosen = [p.strip() for p in paths.split(",") if p.strip()]
        unknown = set(chosen) - set(PATHS)
        if unknown:
            raise SystemExit(f"--rl-shape-paths: unknown {sorted(unknown)}; choose from {PATHS}")
        changes["paths"] = tuple(p for p in PATHS if p in chosen or p == "direct")
    return replace(options, **changes)


def _code_version() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
        diff = subprocess.run(["git", "diff", "HEAD"], capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    if not dirty:
        return head
    digest = hashlib.sha1(diff).hexdigest()[:10]
    return f"{head} + uncommitted changes in {len(dirty)} tracked files (git diff HEAD sha1 {digest})"


def run_shape(
    options: ShapeOptions,
    *,
    out_dir: Path,
    server_cpu: str | None,
    client_cpu: str | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole benchmark (module docstring); returns the result dict (also written to out_dir as JSON)."""
    started = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_log_dir = set_log_dir(out_dir / "logs" / f"rl-shape-{stamp}")
    try:
        return _run_shape(options, started, stamp, out_dir, server_cpu, client_cpu, log)
    finally:
        set_log_dir(previous_log_dir)


def _run_shape(
    options: ShapeOptions,
    started: float,
    stamp: str,
    out_dir: Path,
    server_cpu: str | None,
    client_cpu: str | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    router_py: Path | None = None
    paths = list(options.paths)
    if "sglang-router" in paths:
        router_py = installed_router(log=log)
        if router_py is None:
            paths.remove("sglang-router")
    plan = plan_load(options)
    summary = plan_summary(plan)
    log(
        f"RL shape: {summary['workers']} clients, {summary['turns']} turns, {summary['sessions']} sessions, "
        f"{summary['generated_tokens']:,} tokens per phase; paths {', '.join(paths)}"
    )
    phases: dict[str, PhaseResult] = {}
    sim = start_sim(client_cpu, engines=options.engines, profile="incident", overrides=engine_flags(options))
    try:
        for name in paths:
            gateway: ManagedProcess | None = None
            try:
                if name == "rolloutgate":
                    gateway = start_gateway(
                        server_cpu, sim.extra_urls, extra_args=["--time-scale", f"{options.time_scale:g}"]
                    )
                elif name == "sglang-router":
                    assert router_py is not None
                    gateway = start_router(server_cpu, sim.extra_urls, router_py, options.router_policy)
                log(f"phase {name} ...")
                phase = run_phase(
                    name,
                    plan,
                    options,
                    sim=sim,
                    gateway=gateway,
                    server_cpu=server_cpu,
                    client_cpu=client_cpu,
                    log=log,
                )
            finally:
                if gateway is not None:
                    gateway.stop()
            phases[name] = phase
            s = phase.summary()
            log(
                f"  {name}: {s['turns_ok']}/{s['turns_planned']} ok, {s['failed']} failed, {s['cut']} cut in "
                f"{s['wall_s']:.1f} s; p50 {fmt(s['latency_p50_s'])} s, p99 {fmt(s['latency_p99_s'])} s; "
                f"simulator {s['sim_cores']:.2f} cores"
            )
    finally:
        sim.stop()
    summaries = {name: phase.summary() for name, phase in phases.items()}
    result: dict[str, Any] = {
        "meta": {
            "command": command_line(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "code": _code_version(),
            "machine": machine_description(),
            "pinning": "none (one CPU)"
            if server_cpu is None
            else f"gateway on CPU {server_cpu}; simulator and clients on CPU {client_cpu}",
            "engine_flags": engine_flags(options),
            "rolloutgate_args": ["--time-scale", f"{options.time_scale:g}"],
        },
        "options": asdict(options) | {"concurrency": options.concurrency},
        "plan": summary,
        "phases": summaries,
    }
    result["goals"] = goals(summaries)
    result["limits"] = limits(result)
    result["meta"]["elapsed_s"] = time.time() - started
    path = out_dir / f"rl-shape-{stamp}.json"
    path.write_text(json.dumps(_finite(result), indent=1) + "\n")
    result["meta"]["json"] = str(path)
    return result


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as null (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def run_from_args(args: argparse.Namespace, *, log: Callable[[str], None] = print) -> int:
    """`rolloutgate bench --only rl-shape [--quick] [--rl-shape-* ...]` (bench/perf/cli.py)."""
    options = options_from_args(args)
    server_cpu = getattr(args, "server_cpu", "0")
    client_cpu = getattr(args, "client_cpu", "1")
    if cpu_count() < 2:
        server_cpu = client_cpu = None
    result = run_shape(
        options, out_dir=Path(args.out_dir), server_cpu=server_cpu, client_cpu=client_cpu, log=log
    )
    print()
    print(render(result))
    log(f"results: {result['meta']['json']}")
    return 0
