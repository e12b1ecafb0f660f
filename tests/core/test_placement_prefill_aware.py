"""The prefill-aware policy against plain engine views: the cost it weighs and the choices that follow."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rolloutgate.core.placement import PlacementRequest, PrefillAware
from rolloutgate.core.placement.prefill_aware import prefill_cost


@dataclass
class View:
    """An engine as placement sees it; `budget_free` says whether its prefill budget would take a request."""

    engine_id: str
    order: int = 0
    in_flight: int = 0
    decoding: int = 0
    endured: int = 0  # long prefills its decodes have sat through there, summed
    backlog_tokens: int = 0  # in prefill + waiting for it + its rest
    outstanding_tokens: int = 0
    capacity: int = 16
    budget_free: bool = True

    @property
    def decode_weight(self) -> int:
        return self.decoding + self.endured

    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    def can_admit(self, request: PlacementRequest) -> bool:
        return self.has_room() and self.budget_free


def engines(*specs: dict[str, int | bool]) -> list[View]:
    return [View(engine_id=f"e{i}", order=i, **spec) for i, spec in enumerate(specs)]  # type: ignore[arg-type]


def cold(tokens: int = 100_000, **kw: object) -> PlacementRequest:
    return PlacementRequest(request_id="r", prompt_tokens=tokens, **kw)  # type: ignore[arg-type]


def warm(engine: str = "e0", prompt: int = 102_000, cached: int = 100_000, **kw: object) -> PlacementRequest:
    return cold(prompt, affine_engine=engine, affine_cached_tokens=cached, **kw)


@pytest.mark.parametrize(
    ("request_", "view", "cost"),
    [
        (cold(100_000), View("e0"), 100_000),  # an idle engine: its own prefill
        (cold(100_000), View("e0", decoding=3), 400_000),  # ... and three decodes held meanwhile
        (cold(100_000), View("e0", decoding=3, backlog_tokens=50_000), 450_000),  # after 50K ahead of it
        (warm("e0"), View("e0", decoding=3), 8_000),  # its session's prefix is there: 2K new tokens
        (warm("e0"), View("e1", decoding=3), 408_000),  # anywhere else: the whole history
        (cold(100_000), View("e0", decoding=3, endured=2), 600_000),  # decodes held before weigh more
    ],
)
def test_cost_is_backlog_plus_its_prefill_for_itself_and_every_decode(
    request_: PlacementRequest, view: View, cost: int
) -> None:
    assert prefill_cost(request_, view) == cost


def test_a_long_cold_prompt_goes_where_it_holds_the_fewest_decodes() -> None:
    pool = engines(
        {"in_flight": 4, "decoding": 4}, {"in_flight": 3, "decoding": 1}, {"in_flight": 2, "decoding": 2}
    )
    assert PrefillAware().choose(cold(), pool) == "e1"  # 200K against 500K and 300K
    pool[1].backlog_tokens = 150_000  # e1 is already prefilling a long prompt: 350K there
    assert PrefillAware().choose(cold(), pool) == "e2"  # the storm spreads


def test_among_equal_decode_counts_it_goes_where_the_decodes_were_held_least() -> None:
    pool = engines(
        {"in_flight": 3, "decoding": 3, "endured": 4}, {"in_flight": 3, "decoding": 3, "endured": 1}
    )
    assert (
        PrefillAware().choose(cold(), pool) == "e1"
    )  # 500K against 800K: e0's decodes already sat through 4
    pool[1].endured = 6
    assert PrefillAware().choose(cold(), pool) == "e0"
    fewer = engines({"in_flight": 2, "decoding": 2, "endured": 4}, {"in_flight": 5, "decoding": 5})
    assert PrefillAware().choose(cold(), fewer) == "e1"  # two decodes held 4 more times: 700K against 600K


def test_short_or_cached_prompts_fall_back_to_least_outstanding() -> None:
    pool = engines(
        {"in_flight": 3, "decoding": 3}, {"in_flight": 1, "decoding": 1}, {"in_flight": 1, "decoding": 1}
    )
    assert PrefillAware().choose(cold(0), pool) == "e1"  # no prefill to weigh: fewest in flight, then order
    pool[1].outstanding_tokens = 10
    assert PrefillAware().choose(cold(0), pool) == "e2"  # then fewer prefill tokens in progress


def test_a_session_stays_on_its_engine_while_that_is_cheap() -> None:
    pool = engines({"in_flight": 6, "decoding": 6}, {"in_flight": 0})
    assert PrefillAware().choose(warm("e0"), pool) == "e0"  # 14K there against 102K on the idle engine
    pool[0].backlog_tokens = 80_000  # a long prefill ahead of it there: 94K, still the cheaper wait
    assert PrefillAware().choose(warm("e0"), pool) == "e0"
    pool[0].backlog_tokens = 90_000  # 104K: a cold prefill on the idle engine (102K) is now cheaper
    assert PrefillAware().choose(warm("e0"), pool) == "e1"


def test_ties_keep_the_session_and_a_full_engine_is_waited_for_within_the_bound() -> None:
    pool = engines({"in_flight": 2}, {"in_flight": 0})
    assert PrefillAware().choose(warm("e0", prompt=5000, cached=0), pool) == "e0"  # equal cost: stay
    full = engines({"in_flight": 4, "capacity": 4, "decoding": 4}, {"in_flight": 1, "decoding": 1})
    assert PrefillAware(max_excess=3).choose(warm("e0"), full) is None  # 4 - 1 <= 3: wait for a slot there
    assert PrefillAware(max_excess=2).choose(warm("e0"), full) == "e1"  # beyond the bound: it moves


def test_the_cheapest_engine_is_chosen_even_when_its_budget_must_drain_first() -> None:
    pool = engines(
        {"in_flight": 1, "decoding": 0, "backlog_tokens": 100_000, "budget_free": False},
        {"in_flight": 5, "decoding": 5},
    )
    # e0: wait behind 100K, then hold nobody (200K); e1: hold five decodes now (600K). The gateway parks the
    # request for e0 (dispatcher.py) rather than freeze e1.
    assert PrefillAware().choose(cold(), pool) == "e0"
    pool[0].backlog_tokens = 600_000
    assert PrefillAware().choose(cold(), pool) == "e1"


def test_pinned_and_avoided_engines() -> None:
    pool = engines({"in_flight": 0}, {"in_flight": 5, "decoding": 5})
    assert PrefillAware().choose(cold(pinned_engine="e1"), pool) == "e1"
    pool[1].budget_free = False
    assert PrefillAware().choose(cold(pinned_engine="e1"), pool) is None  # pinned: only when it can admit
    assert PrefillAware().choose(cold(avoid_engines=frozenset({"e0"})), pool) == "e1"
    assert PrefillAware().choose(cold(avoid_engines=frozenset({"e0"})), pool[:1]) == "e0"  # last resort
    nothing = engines({"in_flight": 16}, {"in_flight": 16})
    assert PrefillAware().choose(cold(), nothing) is None
    with pytest.raises(ValueError):
        PrefillAware(-1)
    assert repr(PrefillAware(2)) == "<PrefillAware max_excess=2>"
