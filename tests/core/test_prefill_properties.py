"""Property tests of the core with prefill-aware admission on: the invariants of test_gateway_properties.py
(slots, timings, every request ends once, nothing left after a drain) plus the books of the prefill budget,
the rest and the backlog that placement reads, under random event sequences."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rolloutgate.core.events import ClockMode
from rolloutgate.core.ledger import TimerKind
from tests.core.helpers import Harness, reference
from tests.core.test_gateway_properties import ENGINES, Checker, limits, op

# Fewer request ids and longer prompts than test_gateway_properties.py, so that long prefills run, end and
# wait for budgets often: the rest and the parked backlog get exercised, not only the plain paths.
_rid = st.integers(0, 5).map(lambda i: f"r{i}")
_arrive = st.tuples(
    st.just("arrive"),
    _rid,
    limits,
    st.sampled_from([1000, 5000, 5000, 100_000]),
    st.sampled_from([None, "s0", "s1"]),
    st.integers(0, 2),
    st.booleans(),
    st.sampled_from([None, None, None, "e1"]),
)
_advance = st.tuples(st.just("advance"), st.sampled_from([0.5, 2.0, 7.0]), st.lists(_rid, max_size=4))
_progress = st.tuples(st.just("progress"), _rid, st.integers(0, 3))
prefill_op = st.one_of(_arrive, _arrive, _advance, _advance, _progress, _progress, op)


class PrefillChecker(Checker):
    def __init__(self, rest_ratio: float) -> None:
        super().__init__(ClockMode.ENGINE)
        config = reference(
            retry_grace_s=2.0,
            no_engine_grace_s=20.0,
            placement="prefill_aware",
            prefill_budget_exempt_tokens=4096,
            prefill_rest_ratio=rest_ratio,
        )
        self.h = Harness(config)
        self.h.observer = self.check

    def check(self, out: list[Any]) -> None:
        super().check(out)
        view = self.h.gw.inspect()
        for e in view.engines.values():
            slots = e.slots
            in_prefill = [r for r in e.requests.values() if r.is_in_prefill]
            assert slots.prefilling == len(in_prefill)
            assert slots.budget_tokens == sum(
                r.uncached_tokens for r in in_prefill if r.uncached_tokens >= 4096
            )
            assert slots.is_resting == ((TimerKind.REST, e.engine_id) in view.timers)
            assert not slots.is_resting or slots.budget_tokens == 0  # no long prefill starts during a rest
            if slots.is_resting:
                event("an engine rested")
            if view.queue.lane_weight((e.engine_id, False)):
                event("a prompt waited for an engine's budget")
            queue = view.queue
            waiting = [queue.weight_of(rid) for rid in queue.ids_in_lane((e.engine_id, False))]
            waiting += [queue.weight_of(rid) for rid in queue.ids_in_lane((e.engine_id, True))]
            assert e.backlog_tokens == slots.prefill_tokens + slots.rest_tokens + sum(waiting)
            assert e.endured_prefills == sum(r.prefills_endured for r in e.requests.values())
            assert all(r.prefills_endured == 0 for r in in_prefill)  # only decodes sit through prefills
            if e.endured_prefills:
                event("decodes sat through a long prefill")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rest_ratio=st.sampled_from([0.0, 0.5]), steps=st.lists(prefill_op, min_size=5, max_size=80))
def test_random_event_sequences_keep_the_invariants_with_prefill_admission(
    rest_ratio: float, steps: list[tuple[Any, ...]]
) -> None:
    checker = PrefillChecker(rest_ratio)
    for e in ENGINES[:2]:
        checker.apply(("join", e, 2, 6000.0, True))
    for step in steps:
        checker.apply(step)
    checker.drain()
    assert math.isfinite(checker.h.now)
