"""Body validation (server/validate.py) against the rules written plainly, for random bodies."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutgate.config import GatewaySettings
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest
from rolloutgate.server.validate import validate_body

SETTINGS = GatewaySettings(max_tokens_limit=1000)

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=2000),
    st.floats(allow_nan=False, min_value=-1, max_value=3),
    st.text(max_size=3),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from(["max_new_tokens", "role", "x"]), st.integers(-1, 1500), max_size=2),
)
_FIELDS = [
    "stream",
    "model",
    "temperature",
    "top_p",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "messages",
    "prompt",
    "text",
    "input_ids",
    "sampling_params",
    "rid",
]


def _reference(route: Route, body: dict[str, Any], limit: int) -> None:
    """The rules as first written: one isinstance check per field, in order."""

    def expect(name: str, kinds: type | tuple[type, ...], what: str) -> None:
        value = body.get(name)
        if value is None:
            return
        allowed = kinds if isinstance(kinds, tuple) else (kinds,)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise BadRequest(f"'{name}' must be {what}", param=name, code="invalid_type")

    expect("stream", bool, "a boolean")
    expect("model", str, "a string")
    expect("temperature", (int, float), "a number")
    expect("top_p", (int, float), "a number")
    expect("n", int, "an integer")
    for name in ("max_tokens", "max_completion_tokens"):
        expect(name, int, "an integer")
        value = body.get(name)
        if value is not None and not 0 <= value <= limit:
            raise BadRequest(f"'{name}' must be between 0 and {limit}", param=name, code="invalid_value")
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1", param="n", code="invalid_value")
    if route is Route.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", param="messages", code="invalid_type")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadRequest("messages[i]", param="messages", code="invalid_type")
    elif route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise BadRequest("prompt", param="prompt", code="invalid_type")
    else:
        if isinstance(body.get("text"), str | list) == isinstance(body.get("input_ids"), list):
            raise BadRequest("text", param="text", code="invalid_type")
        if body.get("input_ids") == []:
            raise BadRequest("input_ids", param="input_ids", code="invalid_value")
        expect("sampling_params", dict, "an object")
        expect("rid", str, "a string")
        new_tokens = (body.get("sampling_params") or {}).get("max_new_tokens")
        if new_tokens is not None and (
            not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or not 0 <= new_tokens <= limit
        ):
            raise BadRequest("max_new_tokens", param="sampling_params.max_new_tokens", code="invalid_value")


def _outcome(check: Any, route: Route, body: dict[str, Any]) -> tuple[str, str] | None:
    try:
        check(route, body)
    except BadRequest as error:
        return (error.param or "", error.code)
    return None


@settings(max_examples=400, deadline=None)
@given(
    route=st.sampled_from(list(Route)), body=st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=6)
)
def test_validation_refuses_exactly_what_the_rules_refuse(route: Route, body: dict[str, Any]) -> None:
    if route is Route.CHAT and isinstance(body.get("messages"), list) and len(body["messages"]) > 1:
        body["messages"] = body["messages"][:1]  # below any max_messages
    expected = _outcome(lambda r, b: _reference(r, b, SETTINGS.max_tokens_limit), route, body)
    assert _outcome(lambda r, b: validate_body(r, b, SETTINGS), route, body) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"stream": 1, "input_ids": [1]}, "'stream' must be a boolean"),
        ({"temperature": True, "input_ids": [1]}, "'temperature' must be a number"),
        ({"max_tokens": 5000, "input_ids": [1]}, "'max_tokens' must be between 0 and 1000"),
        (
            {"max_tokens": 5, "max_completion_tokens": "x", "input_ids": [1]},
            "'max_completion_tokens' must be",
        ),
    ],
)
def test_the_first_broken_field_names_itself(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        validate_body(Route.GENERATE, body, SETTINGS)
