from __future__ import annotations

import pytest

from rolloutgate.core import engine_state, request_state
from rolloutgate.core.engine_state import EngineState
from rolloutgate.core.request_state import TERMINAL_STATES, InvalidTransition, RequestState

R = RequestState


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (R.RECEIVED, R.QUEUED),
        (R.QUEUED, R.DISPATCHED),
        (R.DISPATCHED, R.STREAMING),
        (R.STREAMING, R.DONE),
        (R.STREAMING, R.QUEUED),
        (R.DISPATCHED, R.QUEUED),
        (R.QUEUED, R.CANCELLED),
        (R.RECEIVED, R.FAILED),
    ],
)
def test_legal_request_transitions(a: RequestState, b: RequestState) -> None:
    assert request_state.transition(a, b) is b


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (R.RECEIVED, R.DISPATCHED),
        (R.QUEUED, R.STREAMING),
        (R.QUEUED, R.DONE),
        (R.DONE, R.QUEUED),
        (R.FAILED, R.DONE),
        (R.STREAMING, R.DISPATCHED),
        (R.CANCELLED, R.QUEUED),
    ],
)
def test_illegal_request_transitions_raise(a: RequestState, b: RequestState) -> None:
    with pytest.raises(InvalidTransition) as info:
        request_state.transition(a, b)
    assert info.value.current is a and info.value.wanted is b


def test_terminal_states_have_no_way_out() -> None:
    for state in TERMINAL_STATES:
        assert request_state.TRANSITIONS[state] == frozenset()
    assert set(request_state.TRANSITIONS) == set(RequestState)


def test_engine_transitions() -> None:
    E = EngineState
    assert engine_state.transition(E.HEALTHY, E.QUARANTINED) is E.QUARANTINED
    assert engine_state.transition(E.QUARANTINED, E.HEALTHY) is E.HEALTHY
    with pytest.raises(InvalidTransition):
        engine_state.transition(E.QUARANTINED, E.UNHEALTHY)  # a failing check does not end quarantine
    with pytest.raises(InvalidTransition):
        engine_state.transition(E.HEALTHY, E.HEALTHY)
