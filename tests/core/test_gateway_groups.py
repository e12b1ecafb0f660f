"""Groups in the core: siblings placed together, a group aborted whole, each group recorded once."""

from __future__ import annotations

from rolloutgate.core.commands import (
    Abort,
    AbortReason,
    Complete,
    Dispatch,
    Fail,
    FailReason,
    GroupOutcome,
    RecordGroup,
)
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import EngineJoined, GroupAborted, UpstreamFailed
from tests.core.helpers import Harness

PROMPT = 20_000
N = 8


def harness(**config: object) -> Harness:
    """The production defaults (prefill-aware placement), two engines of 16 slots."""
    h = Harness(GatewayCoreConfig(**config))  # type: ignore[arg-type]
    for engine in ("e0", "e1"):
        h.send(EngineJoined(engine_id=engine, capacity=16, prefill_token_budget=32_768))
    return h


def test_siblings_go_where_the_first_one_prefills_their_prompt_and_ungrouped_ones_spread() -> None:
    grouped, ungrouped = harness(), harness()
    for i in range(N):
        grouped.arrive(f"g{i}", group="g", prompt_tokens=PROMPT)
        ungrouped.arrive(f"u{i}", prompt_tokens=PROMPT)
    assert {grouped.engine_of[f"g{i}"] for i in range(N)} == {"e0"}
    assert len(grouped.commands(Dispatch)) == N  # none waits: the siblings' prompts are cached there
    assert {ungrouped.engine_of.get(f"u{i}") for i in range(N)} >= {"e0", "e1"}


def test_when_the_groups_engine_is_over_the_load_bound_the_rest_follow_the_sibling_that_moved() -> None:
    h = Harness(GatewayCoreConfig(affinity_max_excess=2))
    h.send(EngineJoined(engine_id="e0", capacity=4))
    h.send(EngineJoined(engine_id="e1", capacity=4))
    for i in range(6):
        h.arrive(f"g{i}", group="g", prompt_tokens=PROMPT)
    assert [h.engine_of[f"g{i}"] for i in range(6)] == ["e0"] * 4 + ["e1"] * 2


def test_a_group_is_recorded_when_its_slowest_sibling_ends_with_the_prefill_its_placement_saved() -> None:
    h = harness()
    for i in range(N):
        h.arrive(f"g{i}", group="g", prompt_tokens=PROMPT)
    h.arrive("other", prompt_tokens=100)
    for i in range(N):
        h.progress(f"g{i}")
    h.advance(10.0)
    for i in range(N - 1):
        h.finish(f"g{i}")
    assert not h.commands(RecordGroup)  # its slowest sibling still runs
    h.advance(30.0)
    h.finish(f"g{N - 1}")
    h.progress("other")
    h.finish("other")
    assert h.commands(RecordGroup) == [
        RecordGroup(
            group="g",
            outcome=GroupOutcome.FINISHED,
            completion_s=40.0,
            members=N,
            prefill_tokens_saved=(N - 1) * PROMPT,
        )
    ]
    assert h.gw.group_members("g") == () and h.gw.stats().live_requests == 0


def test_aborting_a_group_ends_its_queued_and_running_members_and_nothing_else() -> None:
    h = Harness(GatewayCoreConfig())
    h.send(EngineJoined(engine_id="e0", capacity=2))
    h.arrive("other", prompt_tokens=100)
    for i in range(3):
        h.arrive(f"g{i}", group="g", prompt_tokens=PROMPT)
    assert [d.request_id for d in h.commands(Dispatch)] == ["other", "g0"]  # g1, g2 queued
    out = h.send(GroupAborted(group="g"))
    assert [c for c in out if isinstance(c, Abort)] == [
        Abort(request_id="g0", engine_id="e0", reason=AbortReason.GROUP_ABORTED)
    ]
    assert [(c.request_id, c.reason) for c in out if isinstance(c, Fail)] == [
        ("g0", FailReason.ABORTED),
        ("g1", FailReason.ABORTED),
        ("g2", FailReason.ABORTED),
    ]
    (record,) = [c for c in out if isinstance(c, RecordGroup)]
    assert (record.outcome, record.members) == (GroupOutcome.ABORTED, 3)
    assert out.index(record) > max(out.index(c) for c in out if isinstance(c, Fail))
    assert h.gw.stats().live_requests == 1 and h.gw.stats().queue_depth == 0
    assert h.send(GroupAborted(group="g")) == []  # nothing left: aborting again does nothing
    h.progress("other")
    assert [c.request_id for c in h.finish("other") if isinstance(c, Complete)] == ["other"]


def test_a_failed_member_makes_its_group_failed() -> None:
    h = harness()
    h.arrive("g0", group="g", prompt_tokens=PROMPT)
    h.arrive("g1", group="g", prompt_tokens=PROMPT)
    h.send(UpstreamFailed(request_id="g0", reason="bad request", retryable=False, status=400))
    assert not h.commands(RecordGroup)
    h.progress("g1")
    h.finish("g1")
    (record,) = h.commands(RecordGroup)
    assert (record.outcome, record.members, record.prefill_tokens_saved) == (GroupOutcome.FAILED, 2, PROMPT)
