"""Configuration validation and the observability values (reprs summarise state; tests assert on them)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from rolloutgate.core.admission import EngineSlots
from rolloutgate.core.config import GatewayCoreConfig
from rolloutgate.core.events import EngineJoined, PauseMode
from rolloutgate.core.gate import Gate
from rolloutgate.core.ledger import TimerKind
from rolloutgate.core.liveness import EngineLiveness
from rolloutgate.core.placement import LeastOutstanding, SessionAffinity
from rolloutgate.core.session_table import SessionTable
from rolloutgate.core.timer_heap import TimerHeap
from rolloutgate.core.wait_queue import WaitQueue
from tests.core.helpers import Harness


@pytest.mark.parametrize(
    "kwargs",
    [
        {"retry_grace_s": -1.0},
        {"no_engine_grace_s": math.nan},
        {"prefill_floor_tokens_per_s": 0.0},
        {"stall_recheck_s": 0.0},
        {"engine_stall_timeout_s": 0.0},
        {"max_queue": 0},
        {"max_attempts": 0},
        {"contention_min_prefill_tokens": -1},
        {"placement": "random"},
    ],
)
def test_invalid_config_raises(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        GatewayCoreConfig(**kwargs)  # type: ignore[arg-type]


def test_defaults_are_the_ones_the_gateway_runs() -> None:
    c = GatewayCoreConfig()
    assert (c.max_queue, c.max_attempts, c.no_engine_grace_s, c.retry_grace_s) == (100_000, 3, 30.0, 10.0)
    assert (c.placement, c.prefill_rest_ratio, c.prefill_budget_exempt_tokens) == ("prefill_aware", 0.5, 4096)
    assert c.contention_min_prefill_tokens == c.prefill_budget_exempt_tokens == 4096


def test_gate_transitions() -> None:
    g = Gate()
    assert repr(g) == "<Gate open>" and not g.open()
    assert g.close(PauseMode.DRAIN, 5.0) and not g.close(PauseMode.IN_PLACE, 6.0)
    assert g.is_liveness_suspended and g.closed_at == 5.0 and g.closures == 1
    assert repr(g) == "<Gate closed in_place since 5.000>"
    assert g.open() and not g.is_closed


def test_reprs_summarise_state() -> None:
    h = Harness()
    h.send(EngineJoined(engine_id="e1", capacity=2))
    h.arrive("a", prompt_tokens=10)
    view = h.gw.inspect()
    engine = view.engines["e1"]
    assert repr(engine) == "<EngineRecord e1 healthy [1/2 in flight]>"
    assert repr(engine.slots) == "<EngineSlots [1/2 in flight, 10 prefill tokens]>"
    assert repr(view.requests["a"]) == "<RequestRecord a dispatched on e1 attempt=1>"
    assert "min stall 60.0s" in repr(engine.liveness)
    assert repr(EngineSlots(capacity=1)) == "<EngineSlots [0/1 in flight, 0 prefill tokens]>"
    assert repr(SessionTable(3)) == "<SessionTable [0/3 sessions]>"
    assert repr(WaitQueue()) == "<WaitQueue [0 waiting in 0 lanes]>"
    assert repr(TimerHeap()) == "<TimerHeap [0 live, next at inf]>"
    assert repr(LeastOutstanding()) == "<LeastOutstanding>"
    assert repr(SessionAffinity(3)) == "<SessionAffinity max_excess=3>"
    assert view.dispatcher == "<Dispatcher session_affinity [0 waiting]>"
    assert repr(EngineLiveness(now=0.0)).startswith("<EngineLiveness silent since 0.000")


def test_inspect_is_a_read_only_snapshot() -> None:
    h = Harness()
    h.send(EngineJoined(engine_id="e1", capacity=1))
    h.arrive("a", prompt_tokens=10)
    h.arrive("b", prompt_tokens=10, max_wall_s=30.0)  # waits: e1 is full
    view = h.gw.inspect()
    assert (list(view.requests), list(view.engines), view.queue.ids) == (["a", "b"], ["e1"], ("b",))
    assert "b" in view.queue and "a" not in view.queue and len(view.queue) == 1
    assert view.queue.ids_in_lane(None) == ("b",) and view.queue.ids_in_lane(("e1", True)) == ()
    assert (TimerKind.WALL, "b") in view.timers and not view.is_gate_closed
    with pytest.raises(TypeError):
        view.requests["c"] = view.requests["a"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.is_gate_closed = True  # type: ignore[misc]
    h.finish("a")  # b starts; the view taken before does not change
    assert list(view.requests) == ["a", "b"] and view.queue.ids == ("b",)
    later = h.gw.inspect()
    assert list(later.requests) == ["b"] and not later.queue.ids
