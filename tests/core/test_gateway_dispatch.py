"""Admission, order and placement: capacity, FIFO and priority, affinity with bounded load, prefill budget,
pinned requests, and re-dispatch after refused connections or a departed engine."""

from __future__ import annotations

from rolloutgate.core.commands import Abort, AbortReason, Complete, Dispatch, Fail, FailReason, MarkEngine
from rolloutgate.core.events import (
    EngineHealthChecked,
    EngineJoined,
    EngineLeft,
    UpstreamFailed,
    WeightsUpdated,
)
from tests.core.helpers import Harness, of, reference


def dispatched(h: Harness) -> list[tuple[str, str]]:
    return [(d.request_id, d.engine_id) for d in h.commands(Dispatch)]


def test_capacity_is_respected_and_slots_are_reused() -> None:
    h = Harness()
    h.engines(e1=2)
    for i in range(5):
        h.arrive(f"r{i}")
    assert dispatched(h) == [("r0", "e1"), ("r1", "e1")]
    stats = h.gw.stats()
    assert (stats.in_flight_total, stats.queue_depth, stats.engines[0].in_flight) == (2, 3, 2)
    h.finish("r1")
    assert dispatched(h)[-1] == ("r2", "e1") and h.gw.stats().in_flight_total == 2


def test_fifo_within_priority_lower_value_first() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("running")
    for rid, prio in (("a", 5), ("b", 1), ("c", 5), ("d", 1), ("e", 0)):
        h.arrive(rid, priority=prio)
    order = []
    current = "running"
    for _ in range(5):
        h.finish(current)
        current = h.commands(Dispatch)[-1].request_id
        order.append(current)
    assert order == ["e", "b", "d", "a", "c"]


def test_least_outstanding_spreads_and_ties_break_on_prefill_then_order() -> None:
    h = Harness(reference(placement="least_outstanding"))
    h.engines(e1=4, e2=4, e3=4)
    h.arrive("a", prompt_tokens=5000)
    h.arrive("b", prompt_tokens=100)
    h.arrive("c", prompt_tokens=10)
    h.arrive("d")  # every engine has 1 in flight: fewest prefill tokens (e3: 10)
    assert dispatched(h) == [("a", "e1"), ("b", "e2"), ("c", "e3"), ("d", "e3")]


def test_session_affinity_waits_for_its_engine_without_blocking_others() -> None:
    h = Harness(reference(affinity_max_excess=2))
    h.engines(e1=2, e2=2)
    h.arrive("s1-t1", routing_key="s1")  # e1
    h.arrive("x")  # e2
    h.arrive("y")  # e1 (tie -> order)
    h.finish("s1-t1")
    h.arrive("s1-t2", routing_key="s1")  # back to e1 (1 vs 1 in flight)
    assert dispatched(h)[-1] == ("s1-t2", "e1")
    h.finish("x")
    h.arrive("fill")  # e2 now 1; e1 full (2)
    h.arrive("s1-t3", routing_key="s1")  # e1 full, 2 - 1 <= 2: waits for e1
    h.arrive("z")  # behind it in arrival order, but goes to e2 at once
    assert dispatched(h)[-2:] == [("fill", "e2"), ("z", "e2")]
    assert h.gw.stats().engines[0].waiting == 1
    h.finish("y")
    assert dispatched(h)[-1] == ("s1-t3", "e1")


def test_session_moves_when_its_engine_exceeds_the_load_bound() -> None:
    h = Harness(reference(affinity_max_excess=1))
    h.engines(e1=2, e2=2)
    h.arrive("s1-t1", routing_key="s1")  # e1
    h.arrive("a")  # e2
    h.arrive("b")  # e1 -> full
    h.arrive("s1-t2", routing_key="s1")  # e1 full; e2 has 1: 2 - 1 <= 1, waits for e1
    assert h.gw.stats().queue_depth == 1
    h.finish("a")  # e2 drops to 0: 2 - 0 > 1, the session moves
    assert dispatched(h)[-1] == ("s1-t2", "e2")
    h.finish("s1-t2")
    h.finish("s1-t1")
    h.arrive("s1-t3", routing_key="s1")  # its prefix now lives on e2
    assert dispatched(h)[-1] == ("s1-t3", "e2")


def test_prefill_budget_limits_concurrent_prefill_and_a_huge_prompt_runs_alone() -> None:
    h = Harness()
    h.send(EngineJoined(engine_id="e1", capacity=8, prefill_token_budget=10_000))
    h.arrive("p1", prompt_tokens=6000)
    h.arrive("p2", prompt_tokens=6000)  # 12K > 10K: waits although a slot is free
    h.arrive("p3", prompt_tokens=100)  # FIFO: behind p2
    assert dispatched(h) == [("p1", "e1")]
    h.progress("p1")  # p1's prefill is over: budget free
    assert dispatched(h)[1:] == [("p2", "e1"), ("p3", "e1")]
    h.progress("p2")
    h.progress("p3")
    h.arrive("huge", prompt_tokens=50_000)  # larger than the whole budget: runs, alone
    h.arrive("after", prompt_tokens=10)
    assert dispatched(h)[3:] == [("huge", "e1")]
    h.progress("huge")
    assert dispatched(h)[4:] == [("after", "e1")]


def test_budget_blocked_head_reserves_an_engine_so_it_cannot_starve() -> None:
    h = Harness(reference(affinity_max_excess=100))
    h.send(EngineJoined(engine_id="e1", capacity=8, prefill_token_budget=10_000))
    h.arrive("s-t1", routing_key="s", prompt_tokens=9000)
    h.progress("s-t1")
    h.finish("s-t1")
    h.arrive("p", prompt_tokens=9000)  # in prefill on e1
    h.arrive("big", prompt_tokens=9000)  # does not fit next to p: waits
    h.arrive(
        "s-t2", routing_key="s", prompt_tokens=9100
    )  # 100 uncached would fit, but e1 is reserved for big
    assert dispatched(h)[1:] == [("p", "e1")]
    h.progress("p")
    assert dispatched(h)[2:] == [("big", "e1"), ("s-t2", "e1")]  # big first, then s-t2 fits beside it


def test_pinned_request_waits_for_its_engine_only() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("a")  # e1
    h.arrive("pinned", pinned_engine="e1")
    h.arrive("free")  # e2, not blocked by the pinned one
    assert dispatched(h) == [("a", "e1"), ("free", "e2")]
    h.finish("free")  # a slot on e2 does not take the pinned request
    assert dispatched(h)[-1] == ("free", "e2")
    h.finish("a")
    assert dispatched(h)[-1] == ("pinned", "e1")
    [fail] = of(h.arrive("nowhere", pinned_engine="e9"), Fail)
    assert fail.reason is FailReason.NO_ENGINE


def test_refused_connection_is_redispatched_elsewhere_until_attempts_run_out() -> None:
    h = Harness(reference(max_attempts=3))
    h.engines(e1=1, e2=1, e3=1, e4=1)
    h.arrive("a")
    for engine in ("e1", "e2", "e3"):
        assert h.engine_of["a"] == engine
        out = h.send(UpstreamFailed(request_id="a", reason="connection refused", engine_unreachable=True))
        assert MarkEngine(engine_id=engine, state="unhealthy", detail="connection refused") in out
        assert of(out, Abort) == []  # nothing runs there to abort
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.ATTEMPTS_EXHAUSTED and fail.timing.attempts == 3
    assert [d.attempt for d in h.commands(Dispatch, "a")] == [1, 2, 3]


def test_a_request_two_engines_dropped_in_prefill_fails_where_decoding_ones_move() -> None:
    # An engine that dies drops every call on it. The one it was prefilling may be what killed it; once is no
    # proof (a restart drops prefills too), twice is: it is not sent to kill a third engine.
    h = Harness(reference(max_attempts=5))
    h.engines(e1=2, e2=2, e3=2)
    h.arrive("decoding", routing_key="s")
    h.arrive("poison", routing_key="s")
    assert h.engine_of["decoding"] == h.engine_of["poison"] == "e1"
    h.progress("decoding", tokens=5)
    for engine in ("e1", "e2"):
        assert h.engine_of["poison"] == engine
        out = h.send(UpstreamFailed(request_id="poison", reason="connection lost", engine_lost=True))
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.ENGINE_LOST_IN_PREFILL and "connection lost" in fail.detail
    assert [d.engine_id for d in h.commands(Dispatch, "poison")] == ["e1", "e2"]
    h.send(UpstreamFailed(request_id="decoding", reason="connection lost", engine_lost=True))
    h.progress("decoding", tokens=5)  # it decoded on its second engine before that one died too
    h.send(UpstreamFailed(request_id="decoding", reason="connection lost", engine_lost=True))
    assert len(h.commands(Dispatch, "decoding")) == 3 and not h.commands(Fail, "decoding")


def test_a_call_refused_in_prefill_is_retried_as_it_never_ran() -> None:
    h = Harness()
    h.engines(e1=1, e2=1, e3=1)
    h.arrive("a")
    h.send(UpstreamFailed(request_id="a", reason="connection refused", engine_unreachable=True))
    h.send(UpstreamFailed(request_id="a", reason="HTTP 503", status=503))
    assert [d.engine_id for d in h.commands(Dispatch, "a")] == ["e1", "e2", "e3"]


def test_a_call_its_engines_own_pause_aborted_is_requeued_without_a_fault_counted() -> None:
    # settings.engine_pause_aborts rerun: a trainer's abort-mode pause is no fault of the call or the engine;
    # however often it happens, the call runs again (afresh: new weights may come with the pause)
    h = Harness(reference(max_attempts=2))
    h.engines(e1=1)
    h.arrive("a")
    for attempt in (1, 2, 3):
        h.progress("a", tokens=7)
        out = h.send(UpstreamFailed(request_id="a", reason="paused", engine_paused=True, attempt=attempt))
        assert of(out, Fail) == [] and of(out, MarkEngine) == []
    assert [(d.engine_id, d.attempt, d.delivered_tokens) for d in h.commands(Dispatch, "a")] == [
        ("e1", n, 0) for n in (1, 2, 3, 4)
    ]


def test_non_retryable_failure_is_the_clients_answer() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    out = h.send(UpstreamFailed(request_id="a", reason="bad request", retryable=False, status=400))
    [fail] = of(out, Fail)
    assert fail.reason is FailReason.UPSTREAM and "400" in fail.detail
    assert h.gw.stats().engines[0].state == "healthy"


def test_redispatch_after_visible_output_carries_delivered_tokens() -> None:
    h = Harness()
    h.engines(e1=1, e2=1)
    h.arrive("s", streaming=True)
    h.arrive("n", streaming=False)
    for _ in range(7):
        h.progress("s")
        h.progress("n")
    h.send(UpstreamFailed(request_id="s", reason="reset"))
    h.send(UpstreamFailed(request_id="n", reason="reset"))
    by_id = {d.request_id: d for d in h.commands(Dispatch) if d.attempt == 2}
    assert by_id["s"].delivered_tokens == 7 and by_id["n"].delivered_tokens == 0


def test_a_continuable_call_keeps_its_output_after_a_failure_and_starts_afresh_on_new_weights() -> None:
    """A call the edge can continue (a whole-answer /generate, server/continuation.py) goes on from its output
    when its engine fails; a stale one starts over: what it made is on old weights."""
    h = Harness(reference(max_staleness=0))
    h.engines(e1=1, e2=1)
    h.arrive("c", continuable=True)
    for _ in range(5):
        h.progress("c")
    h.send(UpstreamFailed(request_id="c", reason="reset"))
    [moved] = [d for d in h.commands(Dispatch) if d.attempt == 2]
    assert moved.delivered_tokens == 5
    h.progress("c")
    h.send(WeightsUpdated())  # stale: aborted and queued again, from scratch
    [afresh] = [d for d in h.commands(Dispatch) if d.attempt == 3]
    assert afresh.delivered_tokens == 0


def test_engine_left_moves_its_work_and_fails_its_pinned_requests() -> None:
    h = Harness()
    h.engines(e1=2, e2=2)
    h.arrive("a")  # e1
    h.arrive("b")  # e2
    h.arrive("p", pinned_engine="e1")  # e1
    h.arrive("p2", pinned_engine="e1")  # waits for e1
    out = h.send(EngineLeft(engine_id="e1"))
    assert {(x.request_id, x.reason) for x in of(out, Abort)} == {
        ("a", AbortReason.ENGINE_LEFT),
        ("p", AbortReason.ENGINE_LEFT),
    }
    assert {f.request_id: f.reason for f in of(out, Fail)} == {
        "p": FailReason.NO_ENGINE,
        "p2": FailReason.NO_ENGINE,
    }
    assert [(d.request_id, d.engine_id, d.attempt) for d in of(out, Dispatch)] == [("a", "e2", 2)]
    assert h.send(EngineLeft(engine_id="e1")) == []
    assert [e.engine_id for e in h.gw.stats().engines] == ["e2"]


def test_rejoin_updates_capacity() -> None:
    h = Harness()
    h.engines(e1=1)
    h.arrive("a")
    h.arrive("b")
    h.send(EngineJoined(engine_id="e1", capacity=2))
    assert dispatched(h) == [("a", "e1"), ("b", "e1")]
    out = h.send(EngineJoined(engine_id="e1", capacity=2, healthy=False))
    assert of(out, MarkEngine)[0].state == "unhealthy"
    h.finish("a")
    assert [c.request_id for c in h.commands(Complete)] == ["a"]


def test_waiting_sessions_move_when_their_engine_leaves_or_turns_unhealthy() -> None:
    h = Harness(reference(affinity_max_excess=5))
    h.engines(e1=1, e2=1, e3=1)
    h.arrive("s-t1", routing_key="s")  # e1
    h.arrive("u-t1", routing_key="u")  # e2
    h.arrive("x")  # e3
    h.finish("s-t1")
    h.finish("u-t1")
    h.arrive("y")  # e1 (least loaded, engine order)
    h.arrive("z")  # e2
    h.arrive("s-t2", routing_key="s")
    h.arrive("u-t2", routing_key="u")
    h.finish("x")  # e3 frees a slot, but both sessions are within the bound: they wait for their engines
    assert dispatched(h)[-1] == ("z", "e2")
    assert [e.waiting for e in h.gw.stats().engines] == [1, 1, 0]
    out = h.send(EngineLeft(engine_id="e1"))  # s's engine is gone: s-t2 goes back to the shared lane
    assert [(d.request_id, d.engine_id) for d in of(out, Dispatch)] == [("y", "e3")]  # y was re-queued first
    h.finish("y")
    assert dispatched(h)[-1] == ("s-t2", "e3")
    h.send(EngineJoined(engine_id="e4", capacity=1))
    out = h.send(EngineHealthChecked(engine_id="e2", healthy=False))  # u's engine turned unhealthy
    assert [(d.request_id, d.engine_id) for d in of(out, Dispatch)] == [("u-t2", "e4")]


def test_a_moving_session_waits_when_no_engine_can_take_its_prompt() -> None:
    h = Harness(reference(affinity_max_excess=0))
    h.engines(e1=3)
    h.send(EngineJoined(engine_id="e2", capacity=3, prefill_token_budget=1000))
    h.arrive("s-t1", routing_key="s", pinned_engine="e1")  # the session lives on e1
    h.arrive("a", pinned_engine="e1")
    h.arrive("b", pinned_engine="e1")  # e1 full
    h.arrive("p", prompt_tokens=900, pinned_engine="e2")  # e2: one request, 900 tokens in prefill
    h.finish("s-t1")
    h.arrive("fill", pinned_engine="e1")  # e1 full again
    h.arrive("s-t2", routing_key="s", prompt_tokens=5000)  # e1 is over the bound (3 - 1 > 0): it should move,
    h.arrive("q", prompt_tokens=10)  # but e2 cannot take 5000 tokens now; others are not blocked
    assert dispatched(h)[-1] == ("q", "e2")
    h.progress("p")
    assert dispatched(h)[-1] == ("q", "e2")  # q's 10 tokens are still in prefill: 5000 do not fit yet
    h.progress("q")  # e2's prefill is over: the session moves there
    assert dispatched(h)[-1] == ("s-t2", "e2")


def test_engine_lane_head_that_needs_the_budget_reserves_its_engine() -> None:
    h = Harness()
    h.send(EngineJoined(engine_id="e1", capacity=4, prefill_token_budget=1000))
    h.engines(e2=4)
    h.arrive("a", prompt_tokens=800, pinned_engine="e1")  # e1: 800 tokens in prefill
    h.arrive("b")  # e2
    h.arrive("c")  # e2 (tie on count, fewer prefill tokens)
    h.arrive("p", prompt_tokens=900, pinned_engine="e1")  # waits for e1's budget
    h.arrive("x", prompt_tokens=10)  # e1 is least loaded, but reserved for p: x goes to e2
    assert dispatched(h)[-1] == ("x", "e2")
    h.progress("a")
    assert dispatched(h)[-1] == ("p", "e1")
