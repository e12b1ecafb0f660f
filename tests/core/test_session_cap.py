"""A cap on each session's calls in the gateway (core/session_cap.py): the calls over it wait in order,
outside the queue, blocking nobody; each call of the session that ends lets the oldest waiting one in."""

from __future__ import annotations

import pytest

from rolloutgate.core.commands import Dispatch, Fail
from rolloutgate.core.events import ClientDisconnected, UpstreamFailed
from rolloutgate.core.session_cap import SessionCap
from tests.core.helpers import Harness, reference


def test_calls_over_the_cap_are_held_and_admitted_in_order_one_for_each_that_leaves() -> None:
    cap = SessionCap(2)
    assert [cap.admit("s", f"s{i}") for i in range(4)] == [True, True, False, False]
    assert cap.admit(None, "x") and cap.admit("t", "t0")  # keyless calls and other sessions are not capped
    assert (cap.admitted("s"), cap.held, cap.is_held("s2")) == (2, 2, True)
    assert cap.leave("s", "s3") is None  # a held call that ended before its turn leaves the line
    assert cap.leave("s", "s0") == "s2"  # s2 takes s0's place
    assert (cap.admitted("s"), cap.held, cap.is_held("s2")) == (2, 0, False)
    assert cap.leave("s", "s1") is None and cap.leave("s", "s2") is None
    assert cap.admitted("s") == 0 and cap.leave(None, "x") is None
    assert SessionCap().admit("s", "a") and SessionCap().held == 0  # no cap: nothing counted
    with pytest.raises(ValueError, match="cap"):
        SessionCap(0)


def test_in_the_core_a_sessions_fifth_call_waits_without_blocking_the_calls_behind_it() -> None:
    h = Harness(reference(session_max_in_flight=2))
    h.engines(e0=8)
    for i in range(4):
        h.arrive(f"s{i}", routing_key="s", prompt_tokens=100)
    h.arrive("other", routing_key="t", prompt_tokens=100)
    h.arrive("keyless", prompt_tokens=100)
    assert [d.request_id for d in h.commands(Dispatch)] == ["s0", "s1", "other", "keyless"]
    assert h.gw.stats().queue_depth == 2  # s2, s3 wait in the gateway
    h.progress("s1")
    h.finish("s1")
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "s2"  # the oldest held one, at once
    h.send(ClientDisconnected(request_id="s3"))  # gone while held: it leaves the line
    h.progress("s0")
    h.finish("s0")
    h.progress("s2")
    h.finish("s2")
    h.arrive("s4", routing_key="s", prompt_tokens=100)
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "s4" and h.gw.stats().queue_depth == 0


def test_a_held_call_keeps_its_queue_timeout_and_a_retried_one_stays_admitted() -> None:
    h = Harness(reference(session_max_in_flight=1))
    h.engines(e0=8, e1=8)
    h.arrive("a", routing_key="s", prompt_tokens=100)
    h.arrive("b", routing_key="s", prompt_tokens=100, queue_timeout_s=30.0)
    h.advance(31.0, streams={"a": 1.0})
    assert [f.request_id for f in h.commands(Fail)] == ["b"]  # timed out while held
    h.arrive("c", routing_key="s", prompt_tokens=100)
    h.send(UpstreamFailed(request_id="a", reason="connection reset", retryable=True))
    # a goes again elsewhere: it never left the gateway, so it keeps its place and c is still held
    assert [(d.request_id, d.attempt) for d in h.commands(Dispatch)] == [("a", 1), ("a", 2)]
    h.progress("a")
    h.finish("a")
    assert [d.request_id for d in h.commands(Dispatch)][-1] == "c"
    assert h.gw.stats().queue_depth == 0
