"""Body validation (server/validate.py) against the rules written plainly, for random bodies."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutgate.config import GatewaySettings
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest
from rolloutgate.server.id_scan import scan_flat_ids
from rolloutgate.server.validate import validate_body

SETTINGS = GatewaySettings(max_tokens_limit=1000)

_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=2000),
    st.floats(allow_nan=False, min_value=-1, max_value=3),
    st.text(max_size=3),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(
        st.sampled_from(["max_new_tokens", "max_tokens", "n", "role", "x"]), st.integers(-1, 1500), max_size=2
    ),
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
    "token_ids",
    "request_id",
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
    elif route is Route.TOKENS:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids:
            raise BadRequest("token_ids", param="token_ids", code="invalid_type")
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise BadRequest("sampling_params", param="sampling_params", code="invalid_type")
        expect("request_id", str, "a string")
        max_tokens = params.get("max_tokens")
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 0 <= max_tokens <= limit
        ):
            raise BadRequest("max_tokens", param="sampling_params.max_tokens", code="invalid_value")
        if params.get("n") not in (None, 1):
            raise BadRequest("n", param="sampling_params.n", code="invalid_value")
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


# -- token ids: nothing a client sends may take an engine down -------------------------------------------

VOCAB = 151_936


def _refusal(
    route: Route, body: dict[str, Any], vocab_size: int | None = VOCAB
) -> tuple[str, str, str] | None:
    """(param, code, message) of the BadRequest `validate_body` raises, or None."""
    try:
        validate_body(route, body, SETTINGS, vocab_size=vocab_size)
    except BadRequest as error:
        return (error.param or "", error.code, error.message)
    return None


def _kept(ids: Any) -> orjson.Fragment:
    """The prompt as a large body keeps it (server/prompt_ids.py): its JSON, unparsed (`json`: orjson writes
    no integer past 64 bits)."""
    return orjson.Fragment(json.dumps(ids).encode())


@pytest.mark.parametrize("keep", [False, True], ids=["parsed", "kept"])
@pytest.mark.parametrize(
    ("ids", "where", "code"),
    [
        ([1, 2, 999_999], "input_ids[2]", "token_id_out_of_vocabulary"),
        ([VOCAB], "input_ids[0]", "token_id_out_of_vocabulary"),
        ([5, -1], "input_ids[1]", "invalid_token_id"),
        ([5, 2.0], "input_ids[1]", "invalid_token_id"),
        ([True], "input_ids[0]", "invalid_token_id"),
        ([1, "7"], "input_ids[1]", "invalid_token_id"),
        ([1, None], "input_ids[1]", "invalid_token_id"),
        ([1, [2]], "input_ids[1]", "invalid_token_id"),
        ([[1, 2], [3, 10**30]], "input_ids[1][1]", "token_id_out_of_vocabulary"),
        ([[1], [-3]], "input_ids[1][0]", "invalid_token_id"),
        ([[1], []], "input_ids[1]", "invalid_value"),
    ],
)
def test_generate_ids_outside_the_vocabulary_are_refused_by_position(
    ids: list[Any], where: str, code: str, keep: bool
) -> None:
    refusal = _refusal(Route.GENERATE, {"input_ids": _kept(ids) if keep else ids})
    assert refusal is not None
    param, got_code, message = refusal
    assert (param, got_code) == ("input_ids", code)
    assert message.startswith(f"'{where}'"), message


@pytest.mark.parametrize("keep", [False, True], ids=["parsed", "kept"])
def test_ids_inside_the_vocabulary_pass(keep: bool) -> None:
    for ids in ([0, VOCAB - 1], [[0], [VOCAB - 1, 7]]):
        assert _refusal(Route.GENERATE, {"input_ids": _kept(ids) if keep else ids}) is None
    assert _refusal(Route.COMPLETIONS, {"prompt": _kept([VOCAB - 1]) if keep else [VOCAB - 1]}) is None


def test_the_message_names_the_id_and_the_vocabulary() -> None:
    refusal = _refusal(Route.GENERATE, {"input_ids": [3, 999_999]})
    assert refusal is not None and "999999" in refusal[2] and f"[0, {VOCAB})" in refusal[2]


def test_kept_json_with_whitespace_is_read_as_ids() -> None:
    spaced = orjson.Fragment(b"[ 1,\n\t2 ,151935 ]")
    assert _refusal(Route.GENERATE, {"input_ids": spaced}) is None
    over = orjson.Fragment(b"[ 1,\n\t2 ,151936 ]")
    assert _refusal(Route.GENERATE, {"input_ids": over}) == (
        "input_ids",
        "token_id_out_of_vocabulary",
        "'input_ids[2]' is 151936, outside the engines' vocabulary [0, 151936)",
    )


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        (Route.COMPLETIONS, {"prompt": [1, 999_999]}, "prompt"),
        (Route.COMPLETIONS, {"prompt": [[1], [-1]]}, "prompt"),
        (Route.COMPLETIONS, {"prompt": ["text", 5]}, "prompt"),
        (Route.COMPLETIONS, {"prompt": "x", "input_ids": [999_999]}, "input_ids"),
        (Route.CHAT, {"messages": [{"role": "user"}], "input_ids": [1, 999_999]}, "input_ids"),
    ],
)
def test_every_route_that_takes_ids_checks_them(route: Route, body: dict[str, Any], param: str) -> None:
    refusal = _refusal(route, body)
    assert refusal is not None and refusal[0] == param


def test_texts_are_not_ids() -> None:
    assert _refusal(Route.COMPLETIONS, {"prompt": ["a", "b"]}) is None
    assert _refusal(Route.COMPLETIONS, {"prompt": "999999"}) is None
    assert _refusal(Route.GENERATE, {"text": ["a", "b"]}) is None


def test_an_unknown_vocabulary_still_refuses_what_no_vocabulary_holds() -> None:
    assert _refusal(Route.GENERATE, {"input_ids": [10**12]}, vocab_size=None) is None
    assert _refusal(Route.GENERATE, {"input_ids": _kept([10**12])}, vocab_size=None) is None
    # a flat array is kept only once its scan saw non-negative integers (id_scan): a batch is kept unchecked
    for bad, value in (([-1], [-1]), ([1.5], [1.5]), ([[1], [-2]], _kept([[1], [-2]]))):
        refusal = _refusal(Route.GENERATE, {"input_ids": value}, vocab_size=None)
        assert refusal is not None and refusal[1] == "invalid_token_id", (bad, refusal)


_ID = st.one_of(
    st.integers(min_value=-3, max_value=VOCAB + 3),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.sampled_from([0.5, 1.0, True, None, "1"]),
)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.one_of(
        st.lists(_ID, min_size=1, max_size=8),
        st.lists(st.lists(_ID, max_size=4), min_size=1, max_size=3),
    ),
    vocab_size=st.sampled_from([None, 10, VOCAB]),
)
def test_kept_and_parsed_prompts_get_the_same_verdict_as_the_plain_rule(
    ids: list[Any], vocab_size: int | None
) -> None:
    def plain_rule(prompt: list[Any]) -> bool:
        return bool(prompt) and all(
            type(t) is int and t >= 0 and (vocab_size is None or t < vocab_size) for t in prompt
        )

    is_batch = all(type(item) is list for item in ids)
    fits = all(plain_rule(p) for p in ids) if is_batch else plain_rule(ids)
    parsed = _refusal(Route.GENERATE, {"input_ids": ids}, vocab_size)
    assert (parsed is None) == fits, (ids, parsed)
    if is_batch or vocab_size is not None or scan_flat_ids(json.dumps(ids).encode(), None) > 0:
        assert _refusal(Route.GENERATE, {"input_ids": _kept(ids)}, vocab_size) == parsed
