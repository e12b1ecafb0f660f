"""Prefill-aware admission through the whole core, on the fake clock: the budget, placement, the rest after a
storm of long prefills, and no starvation of a prompt larger than the budget."""

from __future__ import annotations

from rolloutgate.core.commands import Dispatch
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import EngineJoined
from rolloutgate.core.ledger import TimerKind
from tests.core.helpers import Harness, reference

LONG = 100_000  # a session's history: a 30-40 s prefill on the incident's engines
BUDGET = 8192


def prefill_aware(rest: float = 0.0) -> GatewayCoreConfig:
    return reference(placement="prefill_aware", prefill_budget_exempt_tokens=4096, prefill_rest_ratio=rest)


def dispatched(h: Harness) -> list[tuple[str, str]]:
    return [(d.request_id, d.engine_id) for d in h.commands(Dispatch)]


def join(h: Harness, *engines: str, capacity: int = 16, budget: float = BUDGET) -> None:
    for e in engines:
        h.send(EngineJoined(engine_id=e, capacity=capacity, prefill_token_budget=budget))


def decoding(h: Harness, rid: str, engine: str, **kw: object) -> None:
    """A request dispatched to `engine` and past its prefill (it now decodes there)."""
    h.arrive(rid, pinned_engine=engine, prompt_tokens=100, **kw)
    h.progress(rid)


def test_a_second_long_prompt_waits_in_the_gateway_until_the_first_has_its_first_token() -> None:
    h = Harness(prefill_aware())
    join(h, "e1")
    h.arrive("a", prompt_tokens=LONG)
    h.arrive("b", prompt_tokens=LONG)
    assert dispatched(h) == [("a", "e1")] and h.gw.stats().queue_depth == 1
    h.advance(36.0)
    h.progress("a")
    assert dispatched(h)[-1] == ("b", "e1")
    timing = h.gw.timing("b", h.now)
    assert timing.queue_s == 36.0 and timing.contention_s == 0.0  # it waited here, uncharged, not on e1


def test_long_cold_prompts_spread_and_the_extra_one_takes_whichever_engine_frees_first() -> None:
    h = Harness(prefill_aware())
    join(h, "e1", "e2", "e3")
    for i in range(4):
        h.arrive(f"x{i}", prompt_tokens=LONG)
    assert dispatched(h) == [("x0", "e1"), ("x1", "e2"), ("x2", "e3")]  # one long prefill per engine
    h.advance(30.0)
    h.progress("x2")  # e3's prefill ends first: x3, parked for e1 so far, is cheaper there now
    assert dispatched(h)[-1] == ("x3", "e3")
    stats = {e.engine_id: e for e in h.gw.stats().engines}
    assert (stats["e1"].prefill_tokens, stats["e2"].prefill_tokens, stats["e3"].prefill_tokens) == (LONG,) * 3


def test_cold_prompts_avoid_the_engines_with_the_most_decodes() -> None:
    h = Harness(prefill_aware())
    join(h, "e1", "e2")
    for i in range(4):
        decoding(h, f"d{i}", "e1")  # e1 decodes four requests, e2 none
    h.arrive("x0", prompt_tokens=LONG)
    h.arrive("x1", prompt_tokens=LONG)
    # x0 holds nobody on e2. x1: on e1 it would hold four decodes (500K), on e2 it waits for x0 (200K)
    assert dispatched(h)[-2:] == [("d3", "e1"), ("x0", "e2")] and h.gw.stats().queue_depth == 1
    h.advance(35.0)
    h.progress("x0")
    assert dispatched(h)[-1] == ("x1", "e2")


def test_a_cold_prompt_spares_the_decodes_that_already_sat_through_long_prefills() -> None:
    h = Harness(prefill_aware())
    join(h, "e1", "e2")
    decoding(h, "d1", "e1")
    decoding(h, "d2", "e2")
    h.arrive("x0", prompt_tokens=LONG, pinned_engine="e1")
    h.advance(35.0)
    h.progress("x0")  # d1 sat through x0's prefill; d2 was never held
    h.finish("x0")
    engines = dict(h.gw.inspect().engines)
    assert (engines["e1"].decode_weight, engines["e2"].decode_weight) == (2, 1)
    h.arrive("x1", prompt_tokens=LONG)  # one decode on each engine: it goes where it was held least
    assert dispatched(h)[-1] == ("x1", "e2")
    h.finish("d1")  # a decode that leaves takes what it sat through with it
    assert engines["e1"].decode_weight == 0 and engines["e1"].endured_prefills == 0


def test_a_sessions_next_turn_is_not_held_behind_long_prompts_waiting_for_the_budget() -> None:
    h = Harness(prefill_aware())
    join(h, "e1")
    h.arrive("s-t1", routing_key="s", prompt_tokens=LONG)
    h.progress("s-t1")
    h.finish("s-t1")  # the session's 100K prefix is on e1
    h.arrive("x0", prompt_tokens=LONG)  # in prefill on e1
    h.arrive("x1", prompt_tokens=LONG)  # waits for the budget
    h.arrive("s-t2", routing_key="s", prompt_tokens=LONG + 2000)  # 2K new tokens: exempt, goes at once
    assert dispatched(h)[1:] == [("x0", "e1"), ("s-t2", "e1")]


def test_the_engine_rests_between_long_prefills_so_its_decodes_progress() -> None:
    h = Harness(prefill_aware(rest=0.5))
    join(h, "e1")
    decoding(h, "d", "e1")
    h.arrive("x0", prompt_tokens=LONG)
    h.arrive("x1", prompt_tokens=LONG)
    h.advance(36.0)
    h.progress("x0")  # 36 s of long prefill: the engine takes no other for 18 s
    assert dispatched(h)[-1] == ("x0", "e1")
    stats = h.gw.stats().engines[0]
    assert stats.is_resting and stats.prefill_tokens == 0
    h.arrive("small", prompt_tokens=500)  # exempt: not held by the rest
    assert dispatched(h)[-1] == ("small", "e1")
    h.advance(17.9)
    assert dispatched(h)[-1] == ("small", "e1")
    h.advance(0.1)
    assert dispatched(h)[-1] == ("x1", "e1")
    assert h.gw.timing("x1", h.now).queue_s == 54.0


def test_a_rest_ends_early_once_nobody_decodes_there() -> None:
    h = Harness(prefill_aware(rest=1.0))
    join(h, "e1")
    h.arrive("x0", prompt_tokens=LONG)
    h.arrive("x1", prompt_tokens=LONG)
    h.advance(30.0)
    h.progress("x0")  # a 30 s rest begins (x0 itself decodes now)
    h.advance(5.0)
    h.finish("x0")  # nobody decodes: resting helps nobody, the next prefill starts
    assert dispatched(h)[-1] == ("x1", "e1") and not h.gw.stats().engines[0].is_resting
    assert (TimerKind.REST, "e1") not in h.gw.inspect().timers  # and its timer is gone


def test_a_prompt_larger_than_the_budget_runs_alone_and_never_starves() -> None:
    h = Harness(prefill_aware())
    join(h, "e1", capacity=64, budget=16_000)
    prefill_s = {"huge": 20.0}  # mid-size prompts prefill in 1 s, the huge one in 20 s
    started: dict[str, float] = {}
    t0 = h.now
    for t in range(60):  # a 6K prompt every second: two fit the budget at once, so it is never empty
        rid = f"m{t}"
        h.arrive(rid, prompt_tokens=6000)
        if t == 2:
            h.arrive("huge", prompt_tokens=LONG)
        for d in h.commands(Dispatch):
            started.setdefault(d.request_id, h.now - t0)
        for r, at in sorted(started.items(), key=lambda kv: kv[1]):
            requests = h.gw.inspect().requests
            if h.now - t0 >= at + prefill_s.get(r, 1.0) and r in requests and requests[r].is_in_prefill:
                h.progress(r)
        h.advance(1.0)
        for d in h.commands(Dispatch):
            started.setdefault(d.request_id, h.now - t0)
    assert "huge" in started and started["huge"] <= 2.0 + 2.0  # within two 1 s prefills of its arrival
    alone = [r for r, at in started.items() if started["huge"] <= at < started["huge"] + 20.0 and r != "huge"]
    assert alone == []  # nothing else was admitted beside it
    after = sorted(at for r, at in started.items() if r != "huge" and at >= started["huge"])
    assert after and after[0] >= started["huge"] + 20.0  # the others resumed once its prefill was over
