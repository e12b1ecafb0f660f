"""The replay's agents carry their session's token budget (rolloutreplay/agents.py): in the body of
`POST /sessions` with the session API, as the X-Rolloutgate-Max-Seq-Len header on each call without it; with
groups, a storm wave's sessions share one prompt and one group id."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rolloutgate.server.front import GROUP_HEADER
from rolloutreplay.agents import AgentFleet
from rolloutreplay.scenario import ReplayConfig, agent_plan


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[str, list[Any]]]:
    created: list[Any] = []

    async def create(request: web.Request) -> web.Response:
        created.append(await request.json())
        return web.json_response({"session_id": f"s{len(created)}"})

    app = web.Application()
    app.router.add_post("/sessions", create)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}", created
    await server.close()


@pytest.mark.parametrize(
    ("sessions", "max_seq_len", "body", "headers"),
    [
        (True, 131_072, {"max_seq_len": 131_072}, {}),
        (True, None, {}, {}),
        (False, 131_072, None, {"X-Session-Id": "a00-s0", "X-Rolloutgate-Max-Seq-Len": "131072"}),
        (False, None, None, {"X-Session-Id": "a00-s0"}),
    ],
)
async def test_sessions_carry_their_budget(
    gateway: tuple[str, list[Any]],
    sessions: bool,
    max_seq_len: int | None,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> None:
    url, created = gateway
    config = ReplayConfig(sessions=sessions, max_seq_len=max_seq_len)
    async with aiohttp.ClientSession() as http:
        fleet = AgentFleet(config, url, lambda: 0.0, litellm=None, http=http)
        base_url, sent_headers, routing_key = await fleet._base_url("a00-s0")
    assert created == ([] if body is None else [body])
    assert sent_headers == headers
    assert base_url == (f"{url}/sessions/s1/v1" if sessions else f"{url}/v1")
    assert routing_key == ("s1" if sessions else "a00-s0")


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        ReplayConfig(max_seq_len=0)


class CapturingLiteLLM:
    """Answers every call at once and keeps what was sent."""

    ContextWindowExceededError = type("ContextWindowExceededError", (Exception,), {})

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def acompletion(self, **call: Any) -> Any:
        self.calls.append(call)
        message = type("Message", (), {"content": "ok"})
        choice = type("Choice", (), {"message": message})
        return type("Response", (), {"choices": [choice], "usage": None})


@pytest.mark.parametrize("groups", [True, False])
async def test_a_storm_wave_with_groups_is_one_group_with_one_prompt(
    gateway: tuple[str, list[Any]], groups: bool
) -> None:
    """`--groups`: a storm wave's sessions are the n samples of one prompt (GRPO): the same messages, the same
    X-Rolloutgate-Group; without it every session's prompt is its own."""
    url, _created = gateway
    config = ReplayConfig(groups=groups, time_scale=1e6)
    litellm = CapturingLiteLLM()
    group = "storm0" if groups else None
    async with aiohttp.ClientSession() as http:
        fleet = AgentFleet(config, url, lambda: 0.0, litellm=litellm, http=http)
        for index in range(2):
            plan = agent_plan(config, index, storm=True, group=group)
            await fleet._session(plan.next_session(), f"storm0-{index}", 0)
    first, second = litellm.calls
    assert (first["messages"] == second["messages"]) is groups
    assert [c["extra_headers"].get(GROUP_HEADER) for c in litellm.calls] == [group, group]
    assert all(t.ok for t in fleet.turns)
