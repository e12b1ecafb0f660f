"""The RL shape's load: its options, and every worker's turns fixed by the seed (`plan_load`); the ids each
turn sends and the body miles sends them in (`request_body`), and the output ids miles reads back."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from benchmarks.kit.stats import percentile
from rolloutsim.tokens import DEFAULT_VOCAB_SIZE

__all__ = (
    "DEFAULT",
    "DEFAULT_PATHS",
    "FIRST_ID",
    "GATEWAYS",
    "MINE",
    "PATHS",
    "QUICK",
    "ROUTER_PATHS",
    "ROUTING_HEADER",
    "SYSTEM_PREFIX_TOKENS",
    "TOKENS_PER_S",
    "VOCAB_SIZE",
    "ShapeOptions",
    "Turn",
    "draw_max_new",
    "output_ids",
    "plan_load",
    "plan_summary",
    "request_body",
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
# rolloutgate-processes: `rolloutgate serve --processes N` (issue 37, item 3); named with --rl-shape-paths
PATHS = ("direct", "rolloutgate", "rolloutgate-processes", "sglang-router", "smg", "direct-again")
DEFAULT_PATHS = tuple(p for p in PATHS if p != "rolloutgate-processes")
GATEWAYS = ("rolloutgate", "rolloutgate-processes", "sglang-router", "smg")
MINE = ("rolloutgate", "rolloutgate-processes")
ROUTER_PATHS = ("sglang-router", "smg")  # the SGLang Model Gateway: miles' pin, and its newest release
ROUTING_HEADER = "X-SMG-Routing-Key"
# ids as shared int objects: a session's 100K-id list then costs 8 bytes per id in this process, not ~40
_POOL = list(range(VOCAB_SIZE))


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
    paths: tuple[str, ...] = DEFAULT_PATHS
    processes: int = 2  # of the rolloutgate-processes path
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
        "input_len": {"min": inputs[0], "p50": percentile(inputs, 50, method="linear"), "max": inputs[-1]}
        if turns
        else {},
        "max_new": {
            "min": outputs[0],
            "p50": percentile(outputs, 50, method="linear"),
            "mean": sum(outputs) / len(outputs),
            "p99": percentile(outputs, 99, method="linear"),
            "max": outputs[-1],
        }
        if turns
        else {},
    }


# ----------------------------------------------------------------------------------------------- arithmetic


def output_ids(answer: dict[str, Any]) -> list[int]:
    """The answer's output ids as miles reads them (`meta_info.output_token_logprobs`: [logprob, id, _])."""
    meta = answer.get("meta_info") or {}
    logprobs = meta.get("output_token_logprobs")
    pool = _POOL
    if isinstance(logprobs, list) and (logprobs or not answer.get("output_ids")):
        return [pool[entry[1]] for entry in logprobs]
    return [pool[t] for t in answer.get("output_ids") or []]
