"""Property tests: random event sequences against the core's invariants.

Invariants checked after every step: in flight <= capacity (engine mode) and the engine's books agree with its
requests; nothing is dispatched while the gate is closed or to an engine that cannot take work; every request
ends at most once and its record is freed; every timing adds up (wall = queue + paused + contention + charged,
charged <= dispatched); no request is ever charged past its timeout or queued past its queue timeout (deadlines
fire exactly). After a final drain every request has ended exactly once (or was forgotten after its client
left) and no state is left.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rolloutgate.core.commands import Abort, Complete, Dispatch, Fail
from rolloutgate.core.events import (
    ClientAttached,
    ClientDisconnected,
    ClockMode,
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    EnginePaused,
    EngineResumed,
    GateClosed,
    GateOpened,
    PauseMode,
    ProgressReported,
    RequestArrived,
    RequestLimits,
    UpstreamFailed,
    UpstreamFinished,
)
from rolloutgate.core.timing import TimingBreakdown
from tests.core.helpers import DeferringHarness, Harness, reference

ENGINES = ("e1", "e2", "e3")
EPS = 1e-6

limits = st.builds(
    RequestLimits,
    timeout_s=st.sampled_from([5.0, 20.0, 100.0]),
    stall_timeout_s=st.sampled_from([3.0, 10.0, 50.0]),
    queue_timeout_s=st.sampled_from([math.inf, 15.0]),
    max_wall_s=st.sampled_from([math.inf, 60.0]),
)
rid = st.integers(0, 11).map(lambda i: f"r{i}")
engine = st.sampled_from(ENGINES)
arrive = st.tuples(
    st.just("arrive"),
    rid,
    limits,
    st.sampled_from([0, 1000, 5000, 100_000]),
    st.sampled_from([None, "s0", "s1"]),
    st.integers(0, 2),
    st.booleans(),
    st.sampled_from([None, None, None, "e1"]),
)
advance = st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 7.0, 25.0]), st.lists(rid, max_size=8))
progress = st.tuples(st.just("progress"), rid, st.integers(0, 3))
op = st.one_of(
    arrive,
    arrive,
    arrive,
    advance,
    advance,
    advance,
    progress,
    progress,
    st.tuples(st.just("finish"), rid),
    st.tuples(st.just("upstream_failed"), rid, st.booleans(), st.booleans()),
    st.tuples(st.just("disconnect"), rid),
    st.tuples(st.just("attach"), rid),
    st.tuples(st.just("join"), engine, st.integers(1, 3), st.sampled_from([math.inf, 6000.0]), st.booleans()),
    st.tuples(st.just("leave"), engine),
    st.tuples(st.just("health"), engine, st.booleans()),
    st.tuples(st.just("pause"), engine),
    st.tuples(st.just("resume"), engine),
    st.tuples(st.just("gate_close"), st.sampled_from(list(PauseMode))),
    st.tuples(st.just("gate_open")),
)


# mostly arrivals and ends, so that many requests arrive at an empty queue with slots free on several engines
arrival_heavy = st.one_of(
    arrive,
    arrive,
    arrive,
    arrive,
    st.tuples(st.just("finish"), rid),
    st.tuples(st.just("finish"), rid),
    progress,
    advance,
    op,
)


class Checker:
    def __init__(self, mode: ClockMode, harness: type[Harness] = Harness, **config: Any) -> None:
        self.h = harness(reference(clock_mode=mode, retry_grace_s=2.0, no_engine_grace_s=20.0, **config))
        self.mode = mode
        self.session_cap = config.get("session_max_in_flight", math.inf)
        self.arrived: set[str] = set()
        self.ended: Counter[str] = Counter()
        self.limits: dict[str, RequestLimits] = {}
        self.last_engine: dict[str, str] = {}
        self.capacity: dict[str, int] = {}
        self.h.observer = self.check  # after every single handle/on_time call

    def apply(self, step: tuple[Any, ...]) -> None:
        h, kind = self.h, step[0]
        if kind == "arrive":
            _, r, lim, tokens, key, prio, streaming, pinned = step
            if r in h.gw.inspect().requests or r in self.arrived:
                return
            self.arrived.add(r)
            self.limits[r] = lim
            h.send(
                RequestArrived(
                    request_id=r,
                    limits=lim,
                    prompt_tokens=tokens,
                    routing_key=key,
                    priority=prio,
                    streaming=streaming,
                    pinned_engine=pinned,
                )
            )
        elif kind == "progress":
            h.send(ProgressReported(request_id=step[1], tokens=step[2]))
        elif kind == "finish":
            h.send(UpstreamFinished(request_id=step[1]))
        elif kind == "upstream_failed":
            h.send(
                UpstreamFailed(request_id=step[1], reason="x", retryable=step[2], engine_unreachable=step[3])
            )
        elif kind == "disconnect":
            h.send(ClientDisconnected(request_id=step[1]))
        elif kind == "attach":
            h.send(ClientAttached(request_id=step[1]))
        elif kind == "join":
            _, e, cap, budget, healthy = step
            cap = self.capacity.setdefault(e, cap)  # re-joins keep their capacity
            h.send(EngineJoined(engine_id=e, capacity=cap, prefill_token_budget=budget, healthy=healthy))
        elif kind == "leave":
            h.send(EngineLeft(engine_id=step[1]))
        elif kind == "health":
            h.send(EngineHealthChecked(engine_id=step[1], healthy=step[2]))
        elif kind == "pause":
            h.send(EnginePaused(engine_id=step[1]))
        elif kind == "resume":
            h.send(EngineResumed(engine_id=step[1]))
        elif kind == "gate_close":
            h.send(GateClosed(mode=step[1]))
        elif kind == "gate_open":
            h.send(GateOpened())
        else:
            _, dt, streams = step
            h.advance(dt, dict.fromkeys(streams, dt / 3))

    def check(self, out: list[Any]) -> None:
        """Invariants after one core call (dispatches come last in a call, so the state now is theirs)."""
        gw = self.h.gw
        view = gw.inspect()
        for c in out:
            if isinstance(c, Dispatch):
                assert not view.is_gate_closed, "dispatch while the gate is closed"
                assert view.engines[c.engine_id].is_schedulable, "dispatch to an engine that takes no work"
                assert view.requests[c.request_id].engine is view.engines[c.engine_id]
                self.last_engine[c.request_id] = c.engine_id
            elif isinstance(c, Abort):
                assert self.last_engine[c.request_id] == c.engine_id
            elif isinstance(c, (Complete, Fail)):
                self.ended[c.request_id] += 1
                assert self.ended[c.request_id] == 1, f"{c.request_id} ended twice"
                assert c.request_id not in view.requests
                if c.request_id in self.limits:
                    self.check_timing(c.timing, self.limits[c.request_id])
        for e in view.engines.values():
            assert e.slots.in_flight == len(e.requests)
            if self.mode is ClockMode.ENGINE:
                assert e.slots.in_flight <= e.slots.capacity
            assert e.slots.prefill_tokens == sum(
                r.uncached_tokens for r in e.requests.values() if r.is_in_prefill
            )
            assert e.meter.large_prefills == sum(r.is_large_prefill for r in e.requests.values())
            assert e.liveness.large_prefill_tokens >= 0
        now = self.h.now
        for r in view.requests.values():
            self.check_timing(gw.timing(r.request_id, now), r.limits)
            assert (r.engine is None) == (r.request_id in view.queue or r.request_id in view.held)
            assert r.request_id not in view.held or r.request_id not in view.queue
        cap = self.session_cap
        if cap != math.inf:
            admitted = Counter(r.routing_key for r in view.requests.values() if r.request_id not in view.held)
            assert all(n <= cap for key, n in admitted.items() if key is not None), admitted
            assert all(view.requests[rid].routing_key is not None for rid in view.held)

    def check_timing(self, t: TimingBreakdown, lim: RequestLimits) -> None:
        assert min(t.queue_s, t.paused_s, t.contention_s, t.charged_s, t.dispatched_s) >= -EPS
        assert t.charged_s <= t.dispatched_s + EPS
        assert abs(t.wall_s - (t.queue_s + t.paused_s + t.contention_s + t.charged_s + t.forgiven_s)) < 1e-6
        if self.mode is ClockMode.ENGINE:
            assert t.charged_s <= lim.timeout_s + EPS
        else:
            assert t.wall_s <= lim.timeout_s + EPS
        assert t.queue_s <= lim.queue_timeout_s + EPS
        assert t.wall_s <= lim.max_wall_s + EPS

    def drain(self) -> None:
        h = self.h
        self.apply(("gate_open",))
        for e in ENGINES:
            self.apply(("join", e, 2, math.inf, True))
            self.apply(("health", e, True))
            self.apply(("resume", e))
        for _ in range(300):
            if not h.gw.inspect().requests:
                break
            for e in ENGINES:
                self.apply(("health", e, True))
            for r in [r for r in h.gw.inspect().requests.values() if r.engine is not None]:
                self.apply(("finish", r.request_id))
            self.apply(("advance", 7.0, []))
        h.next_deadline()  # a deferring harness recomputes the deadlines its last events moved (none are left)
        stats = h.gw.stats()
        assert (stats.live_requests, stats.queue_depth, stats.in_flight_total, stats.pending_timers) == (
            0,
            0,
            0,
            0,
        )
        assert set(self.ended) | set() <= self.arrived
        assert len(self.ended) + stats.client_gone == len(self.arrived)
        assert all(n == 1 for n in self.ended.values())
        for outcome in sorted({type(c).__name__ + ":" + str(getattr(c, "reason", "")) for _, c in h.log}):
            event(outcome)  # shown by --hypothesis-show-statistics: which rules the examples exercised


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(list(ClockMode)), steps=st.lists(op, min_size=5, max_size=80))
def test_random_event_sequences_keep_the_invariants(mode: ClockMode, steps: list[tuple[Any, ...]]) -> None:
    checker = Checker(mode)
    for e in ENGINES[:2]:
        checker.apply(("join", e, 2, math.inf, True))
    for step in steps:
        checker.apply(step)
    checker.drain()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(list(ClockMode)),
    cap=st.sampled_from([1, 2]),
    steps=st.lists(op, min_size=5, max_size=80),
)
def test_with_a_cap_on_each_sessions_calls_no_session_goes_over_it_and_every_call_still_ends(
    mode: ClockMode, cap: int, steps: list[tuple[Any, ...]]
) -> None:
    checker = Checker(mode, session_max_in_flight=float(cap))
    for e in ENGINES[:2]:
        checker.apply(("join", e, 2, math.inf, True))
    for step in steps:
        checker.apply(step)
    checker.drain()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(list(ClockMode)), steps=st.lists(op, min_size=5, max_size=80))
def test_deferred_deadlines_give_the_same_verdicts_at_the_same_times(
    mode: ClockMode, steps: list[tuple[Any, ...]]
) -> None:
    """Events handled with `defer_deadlines` and flushed before time moves (the driver's way: once per loop
    iteration) give exactly the commands, at exactly the times, of events flushed one by one."""
    eager, deferred = Checker(mode), Checker(mode, DeferringHarness)
    for checker in (eager, deferred):
        for e in ENGINES[:2]:
            checker.apply(("join", e, 2, math.inf, True))
        for step in steps:
            checker.apply(step)
        checker.drain()
    assert deferred.h.log == eager.h.log


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(list(ClockMode)),
    placement=st.sampled_from(["session_affinity", "prefill_aware", "least_outstanding"]),
    budgets=st.tuples(*[st.sampled_from([math.inf, 6000.0])] * 2),
    steps=st.lists(arrival_heavy, min_size=10, max_size=120),
)
def test_direct_arrivals_make_the_decisions_the_queue_would(
    mode: ClockMode, placement: str, budgets: tuple[float, float], steps: list[tuple[Any, ...]]
) -> None:
    """A request arriving at an empty queue is placed without passing through it (`direct_arrivals`): the
    same commands at the same times as through the queue, whatever the sequence (prefill budgets included:
    a request that must wait for one goes through the queue)."""
    queued = Checker(mode, placement=placement, direct_arrivals=False)
    direct = Checker(mode, placement=placement, direct_arrivals=True)
    for checker in (queued, direct):
        for e, budget in zip(ENGINES[:2], budgets, strict=True):
            checker.apply(("join", e, 2, budget, True))
        for step in steps:
            checker.apply(step)
        checker.drain()
    assert direct.h.log == queued.h.log
