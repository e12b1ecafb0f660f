"""Prompts engines died prefilling are refused for a while (server/poison.py), on a fake clock."""

from __future__ import annotations

import pytest

from rolloutgate.engines.base import Route
from rolloutgate.errors import BadRequest
from rolloutgate.server.poison import PoisonPrompts, fingerprint
from rolloutgate.server.prompt_ids import compact_json


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_fingerprint_is_the_engine_input_whatever_else_the_retry_changes() -> None:
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 8}, "rid": "a"}
    retried = {"input_ids": compact_json([7, 8, 9]), "sampling_params": {"temperature": 0.5}, "stream": True}
    assert fingerprint(Route.GENERATE, body) == fingerprint(Route.GENERATE, retried)
    assert fingerprint(Route.GENERATE, body) != fingerprint(Route.GENERATE, {"input_ids": [7, 8]})
    assert fingerprint(Route.GENERATE, {"text": "[7, 8]"}) != fingerprint(
        Route.GENERATE, {"input_ids": [7, 8]}
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert fingerprint(Route.CHAT, chat) == fingerprint(Route.CHAT, {**chat, "max_tokens": 9, "stream": True})
    assert fingerprint(Route.CHAT, chat) != fingerprint(Route.CHAT, {**chat, "tools": [{"type": "function"}]})
    assert fingerprint(Route.CHAT, chat) != fingerprint(Route.COMPLETIONS, {"prompt": chat["messages"]})


def test_a_remembered_prompt_is_refused_until_its_time_and_only_it() -> None:
    clock = FakeClock()
    poison = PoisonPrompts(clock, ttl_s=60.0)
    killer = {"input_ids": [1, 2, 3]}
    poison.check(Route.GENERATE, killer)  # nothing remembered: served
    poison.remember(Route.GENERATE, killer, "req-1")
    clock.now = 59.0
    with pytest.raises(BadRequest) as refused:
        poison.check(Route.GENERATE, {**killer, "rid": "retry"})
    assert (refused.value.status, refused.value.code) == (400, "prompt_lost_engines")
    assert "req-1" in refused.value.message and "1 s more" in refused.value.message
    poison.check(Route.GENERATE, {"input_ids": [1, 2]})  # another prompt: served
    clock.now = 60.0
    poison.check(Route.GENERATE, killer)  # its time is up: served, and forgotten
    assert len(poison) == 0


def test_at_most_capacity_prompts_are_kept_the_oldest_forgotten_first() -> None:
    clock = FakeClock()
    poison = PoisonPrompts(clock, ttl_s=60.0, capacity=2)
    for index in range(3):
        poison.remember(Route.GENERATE, {"input_ids": [index]}, f"req-{index}")
    assert len(poison) == 2
    poison.check(Route.GENERATE, {"input_ids": [0]})  # forgotten
    for index in (1, 2):
        with pytest.raises(BadRequest):
            poison.check(Route.GENERATE, {"input_ids": [index]})
