"""Session token budgets, the pure decision (rolloutgate/token_budget.py): each route's output limit capped to
what `max_seq_len` leaves after the prompt, what that saved, and the answers for a prompt that fills it."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from rolloutgate import token_budget
from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest

GEN = Route.GENERATE
CHAT = Route.CHAT
COMP = Route.COMPLETIONS


@pytest.mark.parametrize(
    ("route", "body", "prompt", "budget", "expected_body", "saved", "no_room"),
    [
        # /generate: max_new_tokens above what is left is lowered, and the difference is saved
        (GEN, {"sampling_params": {"max_new_tokens": 500}}, 800, 1000, {"max_new_tokens": 200}, 300, False),
        (GEN, {"sampling_params": {"max_new_tokens": 100}}, 800, 1000, {"max_new_tokens": 100}, 0, False),
        # no limit set: what the budget leaves becomes the limit, nothing counted as saved
        (GEN, {}, 800, 1000, {"max_new_tokens": 200}, 0, False),
        # a prompt that fills (or passes) the budget leaves no room...
        (GEN, {"sampling_params": {"max_new_tokens": 50}}, 1000, 1000, {"max_new_tokens": 0}, 50, True),
        (GEN, {"sampling_params": {"max_new_tokens": 50}}, 1200, 1000, {"max_new_tokens": 0}, 50, True),
        # ...except for a call that asks for nothing (miles' scoring: max_new_tokens 0)
        (GEN, {"sampling_params": {"max_new_tokens": 0}}, 1200, 1000, {"max_new_tokens": 0}, 0, False),
        # chat: both OpenAI fields are lowered where set; the tighter is the ask
        (CHAT, {"max_tokens": 300, "max_completion_tokens": 250}, 900, 1000, None, 150, False),
        (CHAT, {"max_completion_tokens": 40}, 900, 1000, None, 0, False),
        (CHAT, {}, 900, 1000, None, 0, False),
        (CHAT, {"max_tokens": 10}, 1000, 1000, None, 10, True),
        (COMP, {"max_tokens": 64}, 990, 1000, None, 54, False),
    ],
)
def test_cap_lowers_the_routes_output_limit_to_what_the_budget_leaves(
    route: Route,
    body: dict[str, Any],
    prompt: int,
    budget: int,
    expected_body: dict[str, Any] | None,
    saved: int,
    no_room: bool,
) -> None:
    original = {k: (dict(v) if isinstance(v, dict) else v) for k, v in body.items()}
    capped, decision = token_budget.cap(route, body, prompt_tokens=prompt, max_seq_len=budget)
    assert body == original  # the caller's body is never modified
    assert (decision.saved, decision.has_no_room) == (saved, no_room)
    assert decision.limit == min(
        max(0, budget - prompt), decision.asked if decision.asked is not None else budget
    )
    if route is GEN:
        assert capped["sampling_params"] == expected_body
        return
    fields = [f for f in ("max_completion_tokens", "max_tokens") if f in body] or ["max_tokens"]
    assert {f: capped[f] for f in fields} == dict.fromkeys(fields, decision.limit)


def test_cap_keeps_the_other_sampling_params_and_fields() -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 9, "temperature": 0.5}, "rid": "r"}
    capped, _ = token_budget.cap(GEN, body, prompt_tokens=3, max_seq_len=8)
    assert capped == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.5},
        "rid": "r",
    }


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4}},
        {"text": ["a", "b"]},
        {"input_ids": [1, 2], "sampling_params": [{"max_new_tokens": 4}]},
    ],
)
def test_a_batch_generate_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="one prompt"):
        token_budget.cap(GEN, body, prompt_tokens=3, max_seq_len=100)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"X-Rolloutgate-Max-Seq-Len": "4096"}, 4096),
        ({"x-rolloutgate-max-seq-len": "12"}, 12),
        ({"X-ROLLOUTGATE-MAX-SEQ-LEN": "7"}, 7),
    ],
)
def test_the_header_budget(headers: dict[str, str], expected: int | None) -> None:
    assert token_budget.header_budget(CIMultiDict(headers)) == expected  # as the edges hand them over


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "lots", ""])
def test_a_bad_header_budget_is_a_400(value: str) -> None:
    with pytest.raises(BadRequest) as info:
        token_budget.header_budget({"X-Rolloutgate-Max-Seq-Len": value})
    assert (info.value.status, info.value.code) == (400, "invalid_override")


@pytest.mark.parametrize("value", [0, -1, 1.0, "100", True, [100]])
def test_a_bad_max_seq_len_is_a_400(value: Any) -> None:
    with pytest.raises(BadRequest, match="positive integer"):
        token_budget.parse_max_seq_len(value, param="max_seq_len")


def test_max_seq_len_and_the_tightest_budget() -> None:
    assert token_budget.parse_max_seq_len(None, param="max_seq_len") is None
    assert token_budget.parse_max_seq_len(32_768, param="max_seq_len") == 32_768
    assert token_budget.tightest(None, None) is None
    assert token_budget.tightest(None, 500, 300) == 300


def test_no_room_answers() -> None:
    _, decision = token_budget.cap(
        GEN, {"sampling_params": {"max_new_tokens": 8}}, prompt_tokens=120, max_seq_len=100
    )
    error = token_budget.no_room_error(decision)
    payload = error.payload()["error"]
    assert (error.status, payload["type"], payload["code"]) == (
        400,
        "invalid_request_error",
        "context_length_exceeded",
    )
    # the wording LiteLLM reads as a context window error (its ContextWindowExceededError)
    assert "this model's maximum context length is 100 tokens" in str(payload["message"]).lower()
    answer = token_budget.zero_token_answer({"rid": "mine", "return_logprob": True}, decision, "gw-rid")
    assert answer["text"] == "" and answer["output_ids"] == []
    meta = answer["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs"]) == (120, 0, [])
    plain = token_budget.zero_token_answer({}, decision, "gw-rid")["meta_info"]
    assert plain["id"] == "gw-rid" and "output_token_logprobs" not in plain
