"""The queue's age (Gateway.oldest_queued_s, rolloutgate_queue_oldest_seconds): the longest queue time among the
requests waiting now, on the queue clock, so a closed gate is not counted; 0 once nothing waits."""

from __future__ import annotations

import pytest

from rolloutgate.core.events import GateClosed, GateOpened, PauseMode
from tests.core.helpers import Harness


def test_the_oldest_waiting_request_gives_the_queue_its_age() -> None:
    h = Harness()
    h.engines(e1=1)
    assert h.gw.oldest_queued_s(h.now) == 0.0
    h.arrive("a")  # runs
    h.arrive("b")  # waits from 0 s
    h.advance(10.0, {"a": 1.0})
    assert h.gw.oldest_queued_s(h.now) == pytest.approx(10.0)
    h.arrive("c")  # waits from 10 s
    h.advance(5.0, {"a": 1.0})
    assert h.gw.oldest_queued_s(h.now) == pytest.approx(15.0)
    h.send(GateClosed(mode=PauseMode.DRAIN))
    h.advance(30.0, {"a": 1.0})
    assert h.gw.oldest_queued_s(h.now) == pytest.approx(15.0)  # the closed gate's 30 s are not queue time
    h.send(GateOpened())
    h.advance(5.0, {"a": 1.0})
    assert h.gw.oldest_queued_s(h.now) == pytest.approx(20.0)
    h.finish("a")  # b starts: c is the oldest now, 5 s before the gate closed and 5 s after it opened
    assert h.gw.oldest_queued_s(h.now) == pytest.approx(10.0)
    h.finish("b")
    assert h.gw.oldest_queued_s(h.now) == 0.0
