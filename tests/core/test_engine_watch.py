"""Engine-level progress (core/engine_watch.py): the tracker's credit, and the gateway's verdicts when calls
are watched through their engine's token counter instead of their own tokens, on a fake clock.

`Run` describes a world (requests with a token period and a length on two engines, optionally an engine that
freezes or a request that stalls); `simulate` plays it against the core twice: per token (every token a
progress event, as a streamed call gives) and watched (the first token, then a reading of each engine's
counter every `poll_s`, then the whole answer, as a non-streaming client's call gives). The property test
checks that both see the same verdicts; the unit tests pin each liveness rule of the watched world.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutgate.core.clock import ManualClock
from rolloutgate.core.commands import Abort, Command, Complete, Dispatch, Fail, MarkEngine
from rolloutgate.core.engine_watch import CREDIT_MARGIN_TOKENS, EngineWatch, credit_limit
from rolloutgate.core.events import (
    EngineJoined,
    ProgressReported,
    RequestArrived,
    RequestLimits,
    UpstreamFinished,
)
from rolloutgate.core.gateway import Gateway
from tests.core.helpers import REFERENCE

STALL_S = 30.0
POLL_S = STALL_S / 20  # the gateway's default poll: a twentieth of the stall timeout


# --- the tracker ------------------------------------------------------------------------------------------


def test_credit_limit_is_twice_the_tokens_plus_a_margin_and_unbounded_without_a_limit() -> None:
    assert credit_limit(100) == 200 + CREDIT_MARGIN_TOKENS
    assert credit_limit(None) == math.inf


def test_a_reading_with_tokens_is_progress_for_every_watched_call_and_none_without() -> None:
    watch = EngineWatch()
    assert watch.add("e1", "a", 1, 100) is True
    assert watch.add("e1", "b", 2, None) is False
    assert watch.observe("e1", 0.0, 2) == []
    events = watch.observe("e1", 10.0, 2)
    assert [(e.request_id, e.attempt, e.tokens, e.engine_level) for e in events] == [
        ("a", 1, 0, True),
        ("b", 2, 0, True),
    ]
    assert watch.observe("e2", 10.0, 1) == []  # nothing watched there


def test_a_call_credited_past_its_limit_gets_no_more_progress() -> None:
    watch = EngineWatch()
    watch.add("e1", "short", 1, 10)  # limit 20 + margin
    watch.add("e1", "long", 1, None)
    limit = credit_limit(10)
    share_per_reading = 100.0 / 4  # the engine holds 4 requests: 2 of them ours
    readings_within = math.floor(limit / share_per_reading) + 1  # the reading that crosses still counts
    seen = [{e.request_id for e in watch.observe("e1", 100.0, 4)} for _ in range(readings_within + 3)]
    assert all(s == {"short", "long"} for s in seen[:readings_within])
    assert all(s == {"long"} for s in seen[readings_within:])


def test_the_share_counts_at_least_the_watched_calls() -> None:
    watch = EngineWatch()
    for rid in "abcd":
        watch.add("e1", rid, 1, 1)  # limit 2 + margin each
    # the engine says it holds 1 request (it lost track of three): each call is credited a quarter, so
    # 4 x 256 = 1,024 of its 1,026 after four readings, and the fifth one still counts
    for _ in range(5):
        assert len(watch.observe("e1", float(CREDIT_MARGIN_TOKENS), 1)) == 4
    assert watch.observe("e1", float(CREDIT_MARGIN_TOKENS), 1) == []


def test_re_adding_a_call_moves_it_and_resets_its_credit() -> None:
    watch = EngineWatch()
    watch.add("e1", "a", 1, 1)
    watch.observe("e1", 10_000.0, 1)
    assert watch.observe("e1", 10.0, 1) == []  # over its limit on e1
    watch.add("e2", "a", 2, 1)
    assert not watch.is_watching("e1") and watch.watched("e2") == 1
    [event] = watch.observe("e2", 10.0, 1)
    assert event.attempt == 2
    watch.remove("a")
    watch.remove("a")  # idempotent
    assert not watch.is_watching("e2")


# --- the world --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    period_s: float  # seconds per token
    tokens: int  # its length (and its max_new_tokens)
    prompt_tokens: int = 0


@dataclass(frozen=True)
class Run:
    calls: tuple[Call, ...]
    freeze_at: float | None = None  # engine e1 stops generating anything
    stall: tuple[int, float] | None = None  # (call index, time): that call stops getting tokens
    horizon_s: float = 2_000.0
    timeout_s: float = 10_000.0


@dataclass
class Outcome:
    verdicts: dict[str, tuple[str, float]] = field(default_factory=dict)  # request -> first verdict, time
    quarantined_at: dict[str, float] = field(default_factory=dict)


def simulate(run: Run, *, watched: bool, poll_s: float = POLL_S) -> Outcome:
    """Play `run` against the core (every call arrives and is dispatched at 0); see the module docstring.
    Attempts after the first answer at once: only the first attempts are compared."""
    clock = ManualClock(start_at=0.0)  # run times are seconds since every call was dispatched
    core = Gateway(REFERENCE)
    watch = EngineWatch()
    outcome = Outcome()
    engine_of: dict[str, str] = {}
    live: dict[str, Call] = {}  # first attempts without a verdict yet
    queue: list[tuple[float, int, str, str]] = []  # (time, order, kind, request id)
    order = itertools.count()

    def push(at: float, kind: str, rid: str) -> None:
        heapq.heappush(queue, (at, next(order), kind, rid))

    def stop_of(rid: str) -> float:
        """When the call's tokens stop: its stall, its engine's freeze, or never."""
        stop = math.inf
        if run.stall is not None and rid == f"r{run.stall[0]}":
            stop = run.stall[1]
        if run.freeze_at is not None and engine_of.get(rid) == "e1":
            stop = min(stop, run.freeze_at)
        return stop

    def execute(commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Dispatch) and command.attempt == 1:
                rid = command.request_id
                call = run.calls[int(rid[1:])]
                engine_of[rid], live[rid] = command.engine_id, call
                if watched:
                    watch.add(command.engine_id, rid, 1, call.tokens)
                times = [call.period_s] if watched else [k * call.period_s for k in range(1, call.tokens)]
                for at in times:
                    push(clock.now() + at, "token", rid)
                push(clock.now() + call.tokens * call.period_s, "end", rid)
            elif isinstance(command, Dispatch):
                push(clock.now(), f"retry{command.attempt}", command.request_id)
            elif isinstance(command, Abort | Complete | Fail):
                if isinstance(command, Abort):
                    verdict = command.reason.value
                else:
                    verdict = "complete" if isinstance(command, Complete) else command.reason.value
                outcome.verdicts.setdefault(command.request_id, (verdict, clock.now()))
                live.pop(command.request_id, None)
                watch.remove(command.request_id)
            elif isinstance(command, MarkEngine) and command.state == "quarantined":
                outcome.quarantined_at.setdefault(command.engine_id, clock.now())

    def tokens_between(rid: str, start: float, end: float) -> int:
        """The call's tokens whose times fall in (start, end], none at or after it stopped."""
        call = live[rid]
        end = min(end, stop_of(rid) - 1e-9)
        if end <= start:
            return 0
        last = min(call.tokens, math.floor(end / call.period_s + 1e-9))
        return max(0, last - min(call.tokens, math.floor(start / call.period_s + 1e-9)))

    for engine_id in ("e1", "e2"):
        execute(core.handle(EngineJoined(engine_id=engine_id, capacity=64), clock.now()))
    limits = RequestLimits(timeout_s=run.timeout_s, stall_timeout_s=STALL_S)
    for index, call in enumerate(run.calls):
        arrived = RequestArrived(request_id=f"r{index}", limits=limits, prompt_tokens=call.prompt_tokens)
        execute(core.handle(arrived, clock.now()))
    if watched:
        push(poll_s, "poll", "")
    last_poll = 0.0
    while True:
        event_at = queue[0][0] if queue else math.inf
        deadline = core.next_deadline()
        if min(event_at, deadline) > run.horizon_s:
            return outcome
        clock.advance(max(0.0, min(event_at, deadline) - clock.now()))
        now = clock.now()
        if deadline <= event_at:
            execute(core.on_time(now))
            continue
        _, _, kind, rid = heapq.heappop(queue)
        if kind == "poll":
            for engine_id in ("e1", "e2"):
                on_engine = [r for r in live if engine_of[r] == engine_id]
                tokens = sum(tokens_between(r, last_poll, now) for r in on_engine)
                for progress in watch.observe(engine_id, float(tokens), len(on_engine)):
                    execute(core.handle(progress, now))
            last_poll = now
            push(now + poll_s, "poll", "")
        elif kind.startswith("retry"):
            attempt = int(kind.removeprefix("retry"))
            execute(core.handle(ProgressReported(request_id=rid, tokens=1, attempt=attempt), now))
            execute(core.handle(UpstreamFinished(request_id=rid, attempt=attempt), now))
        elif rid in live and now < stop_of(rid):
            if kind == "token":
                execute(core.handle(ProgressReported(request_id=rid, tokens=1, attempt=1), now))
            else:  # the end: a watched call's answer brings all its tokens at once
                rest = live[rid].tokens - 1 if watched else 1
                execute(core.handle(ProgressReported(request_id=rid, tokens=rest, attempt=1), now))
                execute(core.handle(UpstreamFinished(request_id=rid, attempt=1), now))


# --- the rules, watched -----------------------------------------------------------------------------------


def test_no_fault_everything_completes_in_both_worlds() -> None:
    run = Run(calls=tuple(Call(period_s=1 / 70, tokens=2_000) for _ in range(4)))
    for watched in (False, True):
        verdicts = simulate(run, watched=watched).verdicts
        assert {v for v, _ in verdicts.values()} == {"complete"}, watched


def test_a_frozen_engine_is_caught_within_stall_timeout_plus_a_poll() -> None:
    calls = tuple(Call(period_s=1 / 70, tokens=20_000) for _ in range(4))  # r0, r2 on e1; r1, r3 on e2
    run = Run(calls=calls, freeze_at=100.0, horizon_s=400.0)
    per_token = simulate(run, watched=False)
    watched = simulate(run, watched=True)
    assert per_token.quarantined_at["e1"] == pytest.approx(100.0 + STALL_S, abs=0.02)  # its last token
    late = watched.quarantined_at["e1"] - per_token.quarantined_at["e1"]
    assert 0 <= late <= POLL_S + 1e-6  # a twentieth of the stall timeout: within +5%
    assert "e2" not in watched.quarantined_at
    for outcome in (per_token, watched):
        assert {rid: v for rid, (v, _) in outcome.verdicts.items()} == {
            "r0": "engine_hung",
            "r2": "engine_hung",
            "r1": "complete",
            "r3": "complete",
        }


def test_three_tokens_a_second_during_a_long_prefill_is_never_stuck() -> None:
    # r0 decodes at 3 tok/s (another session's long prefill on its engine); r2 is that 100K-token prefill
    calls = (
        Call(period_s=1 / 3, tokens=600),
        Call(period_s=1 / 70, tokens=10_000),
        Call(period_s=40.0, tokens=2, prompt_tokens=100_000),
    )
    outcome = simulate(Run(calls=calls, horizon_s=400.0), watched=True)
    assert {rid: v for rid, (v, _) in outcome.verdicts.items()} == {
        "r0": "complete",
        "r1": "complete",
        "r2": "complete",
    }
    assert outcome.quarantined_at == {}


def test_a_call_stuck_alone_is_caught_after_its_credit_runs_out_plus_stall_timeout() -> None:
    # r0 (500 tokens) stops at 2 s while r2 on the same engine (e1) goes on at 35 tok/s; r0 is credited half
    # of e1's tokens: (70 + 35) / 2 tok/s for 2 s, then 35 / 2, until it passes its limit (2 x 500 + 1024)
    calls = (
        Call(period_s=1 / 70, tokens=500),
        Call(period_s=1 / 70, tokens=100_000),
        Call(period_s=1 / 35, tokens=100_000),
    )
    run = Run(calls=calls, stall=(0, 2.0), horizon_s=300.0)
    per_token = simulate(run, watched=False).verdicts
    watched = simulate(run, watched=True).verdicts
    assert per_token["r0"] == ("stuck", pytest.approx(2.0 + STALL_S, abs=0.05))
    verdict, at = watched["r0"]
    credit_runs_out_s = 2.0 + (credit_limit(500) - 105.0 / 2 * 2.0) / (35.0 / 2)
    assert verdict == "stuck"
    assert credit_runs_out_s + STALL_S - POLL_S <= at <= credit_runs_out_s + STALL_S + 2 * POLL_S
    assert all(rid not in watched for rid in ("r1", "r2"))  # still running, nobody else judged


def test_engine_progress_does_not_end_a_large_prefill_before_the_floor_rate_allows() -> None:
    """A watched 100K-token prefill ends (for contention) at its own first token, or once 100K tokens at
    the floor rate (2,000 tok/s: 50 s) have passed, not at the first reading showing its neighbours' tokens."""
    h_core = Gateway(REFERENCE)
    clock = ManualClock()
    h_core.handle(EngineJoined(engine_id="e1", capacity=8), clock.now())
    h_core.handle(RequestArrived(request_id="a"), clock.now())
    h_core.handle(RequestArrived(request_id="big", prompt_tokens=100_000), clock.now())
    clock.advance(10.0)
    h_core.handle(ProgressReported(request_id="a"), clock.now())
    h_core.handle(ProgressReported(request_id="big", tokens=0, engine_level=True), clock.now())
    assert h_core.stats().engines[0].large_prefills == 1  # its neighbours are still in contention
    clock.advance(41.0)  # 51 s after dispatch
    h_core.handle(ProgressReported(request_id="big", tokens=0, engine_level=True), clock.now())
    assert h_core.stats().engines[0].large_prefills == 0


_calls = st.builds(
    Call,
    period_s=st.sampled_from([1 / 70, 1 / 35, 1 / 8]),
    tokens=st.integers(min_value=50, max_value=1_000),
)


@settings(max_examples=30, deadline=None)
@given(
    calls=st.lists(_calls, min_size=1, max_size=5),
    fault=st.sampled_from(["none", "freeze"]),
    fault_at=st.floats(min_value=1.0, max_value=100.0),
)
def test_per_token_and_engine_level_watching_agree(calls: list[Call], fault: str, fault_at: float) -> None:
    """Every run without a fault completes in both worlds. With engine e1 frozen, each call gets the same
    verdict in both: complete, or caught without progress and moved elsewhere; where per-token watching
    quarantines e1, the watched world does too, at most one poll later.

    One case differs in the kind of catch, not in the outcome: a call left alone on e1 when it froze, just
    after a neighbour's last token. Per token, the engine showed progress after the call's own last token,
    so the call is "stuck" (and the engine, now idle, is not judged); watched, the engine's silence is all
    there is to see, so the engine is "hung" and quarantined. Both move the call."""
    run = Run(calls=tuple(calls), freeze_at=fault_at if fault == "freeze" else None, horizon_s=400.0)
    per_token = simulate(run, watched=False)
    watched = simulate(run, watched=True)

    def outcome(verdict: str) -> str:
        return "moved" if verdict in ("engine_hung", "stuck") else verdict

    assert {r: outcome(v) for r, (v, _) in watched.verdicts.items()} == {
        r: outcome(v) for r, (v, _) in per_token.verdicts.items()
    }
    if fault == "none":
        assert {v for v, _ in watched.verdicts.values()} <= {"complete"} and not watched.quarantined_at
    for engine_id, at in per_token.quarantined_at.items():
        assert 0 <= watched.quarantined_at[engine_id] - at <= POLL_S + 1e-6
    if watched.quarantined_at.keys() - per_token.quarantined_at.keys():  # only e1 can freeze
        moved = [v for v, _ in per_token.verdicts.values() if v in ("engine_hung", "stuck")]
        assert moved and set(moved) == {"stuck"}


@settings(max_examples=25, deadline=None)
@given(
    stalled=st.integers(min_value=10, max_value=400),
    stall_at=st.floats(min_value=0.5, max_value=20.0),
    neighbours=st.integers(min_value=1, max_value=3),
)
def test_a_stall_among_busy_neighbours_is_stuck_in_both_worlds(
    stalled: int, stall_at: float, neighbours: int
) -> None:
    """A call that stops while the calls beside it on its engine run on (longer than either world needs to
    judge it) is stuck in both worlds, and nobody else is judged."""
    # neighbours at 70 tok/s for 143 s, alternating between the engines: r0's share of e1's tokens (35 tok/s
    # or more) passes its limit (<= 1,824 tokens) within ~53 s, so the watched verdict (+ stall_timeout) falls
    # inside the horizon, while the neighbours still run
    busy = tuple(Call(period_s=1 / 70, tokens=10_000) for _ in range(2 * neighbours))
    run = Run(calls=(Call(period_s=1 / 70, tokens=stalled), *busy), stall=(0, stall_at), horizon_s=120.0)
    for watched in (False, True):
        verdicts = simulate(run, watched=watched).verdicts
        if stall_at >= stalled / 70:
            assert verdicts == {"r0": ("complete", pytest.approx(stalled / 70))}, watched
        else:
            assert list(verdicts) == ["r0"] and verdicts["r0"][0] == "stuck", watched
