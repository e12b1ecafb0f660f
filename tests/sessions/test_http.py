"""The session API over HTTP (loopback aiohttp server, fake dispatcher): the OpenAI SDK and LiteLLM pointed at
`.../sessions/{id}/v1` unchanged, status codes, keep-alive and errors after it, proxying."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rolloutgate.core.clock import ManualClock
from rolloutgate.errors import Timeout, Unauthorized
from rolloutgate.sessions.http import add_session_routes, default_keepalive
from rolloutgate.sessions.registry import SessionLimits, SessionRegistry
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.service import SessionAnswer, SessionCall, SessionService
from rolloutgate.sessions.testing import WEATHER_TOOL, ScriptedGenerate
from tests.sim.helpers import wait_until

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@dataclass
class Harness:
    url: str
    service: SessionService
    clock: ManualClock
    engine: ScriptedGenerate
    http: aiohttp.ClientSession

    async def new_session(self) -> str:
        async with self.http.post(f"{self.url}/sessions") as response:
            assert response.status == 200
            return str((await response.json())["session_id"])


class Switchable:
    """A dispatcher that plays `engine`, or waits on a gate first, or fails, as a test sets it."""

    def __init__(self, engine: ScriptedGenerate) -> None:
        self.engine = engine
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.answer: SessionAnswer | None = None
        self.waiting = asyncio.Event()
        self.proxied: list[SessionCall] = []
        self.generations = 0  # `/generate` calls received

    async def __call__(self, call: SessionCall) -> SessionAnswer:
        if call.path != "/generate":
            self.proxied.append(call)
            return SessionAnswer(status=201, body=b'{"proxied": true}', headers={"X-Upstream": "yes"})
        self.generations += 1
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        if self.answer is not None:
            return self.answer
        return await self.engine(call)


async def start(
    renderer: ChatRenderer, replies: list[str], **options: Any
) -> tuple[Harness, TestServer, Switchable]:
    clock = ManualClock()
    engine = ScriptedGenerate(renderer, replies=replies)
    dispatcher = Switchable(engine)
    service = SessionService(
        SessionRegistry(SessionLimits(idle_ttl_s=60)), dispatcher, clock, renderer=renderer
    )
    app = web.Application()
    add_session_routes(app, service, **options)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    http = aiohttp.ClientSession()
    return Harness(str(server.make_url("")).rstrip("/"), service, clock, engine, http), server, dispatcher


@pytest.fixture
async def harness(renderer: ChatRenderer) -> AsyncIterator[tuple[Harness, Switchable]]:
    h, server, dispatcher = await start(
        renderer,
        [TOOL_CALL, "It is sunny and 21 degrees.", "Bye."] * 3,
        keepalive=default_keepalive(0.05),
    )
    yield h, dispatcher
    await h.http.close()
    await server.close()


async def test_openai_sdk_runs_a_tool_using_agent_unchanged(harness: tuple[Harness, Switchable]) -> None:
    h, _ = harness
    sid = await h.new_session()
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = await client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')  # type: ignore[union-attr]
    assert first.choices[0].logprobs is None
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"t": 21}'}]
    second = await client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL], logprobs=True
    )
    assert second.choices[0].message.content == "It is sunny and 21 degrees."
    assert second.choices[0].logprobs is not None and len(second.choices[0].logprobs.content or []) > 0
    messages += [second.choices[0].message, {"role": "user", "content": "Thanks"}]
    stream = await client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[WEATHER_TOOL],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Bye."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    async with h.http.get(f"{h.url}/sessions/{sid}/trajectory") as response:
        trajectory = await response.json()
    seen, produced = h.engine.seen_input_ids, h.engine.produced_output_ids
    assert trajectory["token_ids"] == seen[-1] + produced[-1]
    assert sum(trajectory["loss_mask"]) == sum(len(p) for p in produced)
    async with h.http.get(f"{h.url}/sessions/{sid}") as response:
        described = await response.json()
    assert described["session_id"] == sid and len(described["records"]) == 3
    assert [r["prompt_token_ids"] for r in described["records"]] == seen
    async with h.http.get(f"{h.url}/sessions/{sid}?prompt_ids=delta") as response:
        assert "prompt_new_token_ids" in (await response.json())["records"][1]
    await client.close()


async def test_litellm_runs_against_the_session_url(harness: tuple[Harness, Switchable]) -> None:
    litellm = pytest.importorskip("litellm")  # installed by the test extra; import is slow, so once here
    h, _ = harness
    sid = await h.new_session()
    response = await litellm.acompletion(
        model="openai/tiny",
        api_base=f"{h.url}/sessions/{sid}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        num_retries=0,
    )
    message = response.choices[0].message
    assert message.tool_calls[0].function.name == "get_weather"
    # the agent echoes LiteLLM's own message object back: the session still extends
    follow_up = await litellm.acompletion(
        model="openai/tiny",
        api_base=f"{h.url}/sessions/{sid}/v1",
        api_key="unused",
        num_retries=0,
        messages=[
            {"role": "user", "content": "Weather?"},
            message,
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21"},
        ],
        tools=[WEATHER_TOOL],
    )
    assert follow_up.choices[0].message.content == "It is sunny and 21 degrees."
    seen, produced = h.engine.seen_input_ids, h.engine.produced_output_ids
    assert seen[1][: len(seen[0]) + len(produced[0])] == seen[0] + produced[0]


async def test_status_codes(harness: tuple[Harness, Switchable]) -> None:
    h, _ = harness
    sid = await h.new_session()
    url = f"{h.url}/sessions/{sid}/v1/chat/completions"
    async with h.http.post(url, data=b"{not json") as response:
        assert response.status == 400
    async with h.http.post(url, json={"messages": [{"role": "user", "content": "x"}], "n": 3}) as response:
        assert (response.status, (await response.json())["error"]["code"]) == (400, "unsupported_parameter")
    first = [{"role": "user", "content": "x"}]
    async with h.http.post(url, json={"messages": first}) as response:
        reply = (await response.json())["choices"][0]["message"]
        assert response.headers["X-Rolloutgate-Session-Recorded"] == "true"
        assert response.headers["X-Rolloutgate-Engine"] == "engine-0"
        assert response.headers["X-Rolloutgate-Timing"].startswith("wall=0.500")
    second = [*first, reply, {"role": "user", "content": "w"}]
    async with h.http.post(url, json={"messages": second}) as response:
        assert response.status == 200
    # a first message edited under two turns: rolling back both is refused (one turn back at most)
    diverged = [{"role": "user", "content": "y"}, reply, {"role": "user", "content": "z"}]
    async with h.http.post(url, json={"messages": diverged}) as response:
        error = (await response.json())["error"]
        assert (response.status, error["code"], error["type"]) == (
            400,
            "session_diverged",
            "invalid_request_error",
        )
        assert error["message"].startswith("rollback failed: discard_count=2 exceeds")
    async with h.http.get(f"{h.url}/sessions/nope") as response:
        assert (response.status, (await response.json())["error"]["code"]) == (404, "session_not_found")
    h.clock.advance(61)
    async with h.http.get(f"{h.url}/sessions/{sid}") as response:
        assert (response.status, (await response.json())["error"]["code"]) == (410, "session_gone")
    async with h.http.post(url, json={"messages": first}) as response:
        assert response.status == 410
    other = await h.new_session()
    async with h.http.delete(f"{h.url}/sessions/{other}") as response:
        assert response.status == 204
    async with h.http.delete(f"{h.url}/sessions/{other}") as response:
        assert response.status == 404


async def test_keepalive_then_answer(harness: tuple[Harness, Switchable]) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    url = f"{h.url}/sessions/{sid}/v1/chat/completions"
    async with h.http.post(url, json={"messages": [{"role": "user", "content": "x"}]}) as response:
        assert response.status == 200  # committed by the first keep-alive byte
        assert await response.content.readexactly(2) == b"  "
        dispatcher.gate.set()
        body = await response.read()
    parsed = orjson.loads(body)  # leading whitespace is valid JSON
    assert parsed["choices"][0]["message"]["role"] == "assistant"
    assert parsed["rolloutgate_timing"]["engine_id"] == "engine-0"


async def test_streaming_keepalive_then_error_event(harness: tuple[Harness, Switchable]) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    dispatcher.fail = Timeout("charged engine time passed the request's timeout")
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    await dispatcher.waiting.wait()
    dispatcher.gate.set()
    with pytest.raises(openai.APIError, match="timeout"):
        async for _ in stream:
            pass
    await client.close()
    assert h.service.registry.stats().turns_in_flight == 0


async def test_non_streaming_error_after_keepalive_is_the_error_object_then_a_second_value(
    harness: tuple[Harness, Switchable],
) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    dispatcher.fail = Timeout("charged engine time passed the request's timeout")
    url = f"{h.url}/sessions/{sid}/v1/chat/completions"
    async with h.http.post(url, json={"messages": [{"role": "user", "content": "x"}]}) as response:
        assert response.status == 200
        await response.content.readexactly(1)
        dispatcher.gate.set()
        body = await response.read()  # the body ends normally: no cut connection for a client to retry on
    error, end = orjson.loads(body.split(b"\n")[0]), body.split(b"\n", 1)[1]
    assert error["error"]["code"] == "timeout" and end.strip().startswith(b'{"rolloutgate"')


KEEPALIVE_S = 0.05  # the harness' keep-alive interval
COMMITTED_AFTER_S = 0.5  # ten intervals: the 200 is committed by keep-alive before the turn fails


@pytest.mark.looptime
@pytest.mark.parametrize("client", ["openai", "litellm"])
async def test_a_turn_that_fails_after_keepalive_starts_no_second_generation(
    harness: tuple[Harness, Switchable], client: str
) -> None:
    """RL rollouts' own path: the agent's client, with its retries on, raises once and sends nothing again."""
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    dispatcher.fail = Timeout("charged engine time passed the request's timeout")
    messages = [{"role": "user", "content": "x"}]

    async def fail_late() -> None:
        await dispatcher.waiting.wait()
        await asyncio.sleep(COMMITTED_AFTER_S)
        assert dispatcher.gate is not None
        dispatcher.gate.set()

    releaser = asyncio.create_task(fail_late())
    if client == "openai":
        sdk = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=2)
        with pytest.raises(json.JSONDecodeError):  # a 200 whose body is not one JSON value (docs/clients.md)
            await sdk.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
        await sdk.close()
    else:
        litellm = pytest.importorskip("litellm")
        with pytest.raises(litellm.InternalServerError):
            await litellm.acompletion(
                model="openai/tiny",
                api_base=f"{h.url}/sessions/{sid}/v1",
                api_key="unused",
                messages=messages,
                num_retries=3,  # Harbor's, in the incident
            )
    await releaser
    assert dispatcher.generations == 1  # one generation: no client retried
    assert h.service.registry.stats().turns_in_flight == 0


async def test_an_error_before_keepalive_keeps_its_status(harness: tuple[Harness, Switchable]) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.fail = Timeout("charged engine time passed the request's timeout")
    url = f"{h.url}/sessions/{sid}/v1/chat/completions"
    async with h.http.post(url, json={"messages": [{"role": "user", "content": "x"}]}) as response:
        assert (response.status, (await response.json())["error"]["code"]) == (504, "timeout")


async def test_other_paths_are_proxied_with_the_session_as_routing_key(
    harness: tuple[Harness, Switchable],
) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    async with h.http.post(f"{h.url}/sessions/{sid}/v1/completions?x=1", json={"prompt": "hi"}) as response:
        assert (response.status, await response.json()) == (201, {"proxied": True})
        assert response.headers["X-Upstream"] == "yes"
    call = dispatcher.proxied[0]
    assert (call.routing_key, call.method, call.path, call.query, call.body) == (
        sid,
        "POST",
        "/v1/completions",
        "x=1",
        {"prompt": "hi"},
    )
    async with h.http.get(f"{h.url}/sessions/unknown/v1/models") as response:
        assert response.status == 404


async def test_an_injected_proxy_handler_serves_other_paths(renderer: ChatRenderer) -> None:
    seen: list[tuple[str, str]] = []

    async def proxy(request: web.Request, session_id: str, path: str) -> web.StreamResponse:
        seen.append((session_id, path))
        return web.json_response({"via": "gateway"})

    h, server, _ = await start(renderer, ["x"], proxy=proxy)
    try:
        sid = await h.new_session()
        async with h.http.get(f"{h.url}/sessions/{sid}/v1/models") as response:
            assert await response.json() == {"via": "gateway"}
        assert seen == [(sid, "/v1/models")]
    finally:
        await h.http.close()
        await server.close()


@pytest.mark.looptime
async def test_the_sweeper_evicts_idle_sessions(renderer: ChatRenderer) -> None:
    h, server, _ = await start(renderer, ["x"], sweep_interval_s=0.01)
    try:
        sid = await h.new_session()
        h.clock.advance(61)
        await wait_until(lambda: len(h.service.registry) == 0, "the sweeper ran")  # every 10 ms
        assert h.service.registry.stats().evicted_idle_ttl_total == 1
        async with h.http.get(f"{h.url}/sessions/{sid}") as response:
            assert response.status == 410
    finally:
        await h.http.close()
        await server.close()


async def test_authorize_guards_every_route(renderer: ChatRenderer) -> None:
    def authorize(request: web.Request) -> None:
        if request.headers.get("Authorization") != "Bearer good":
            raise Unauthorized("a valid API key is required")

    h, server, _ = await start(renderer, ["x"], authorize=authorize)
    try:
        async with h.http.post(f"{h.url}/sessions") as response:
            assert (response.status, (await response.json())["error"]["code"]) == (401, "invalid_api_key")
        async with h.http.post(f"{h.url}/sessions", headers={"Authorization": "Bearer good"}) as response:
            sid = (await response.json())["session_id"]
        client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="good", max_retries=0)
        answer = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}]
        )
        assert answer.choices[0].message.content == "x"
        await client.close()
    finally:
        await h.http.close()
        await server.close()


async def test_an_engine_error_after_keepalive_reaches_a_streaming_sdk(
    harness: tuple[Harness, Switchable],
) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    dispatcher.answer = SessionAnswer(status=400, body=b'{"object": "error", "message": "context too long"}')
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    await dispatcher.waiting.wait()
    dispatcher.gate.set()
    with pytest.raises(openai.APIError, match="context too long"):
        async for _ in stream:
            pass
    await client.close()
    assert h.service.registry.stats().records == 0


@pytest.mark.looptime
async def test_a_client_that_leaves_cancels_its_turn(harness: tuple[Harness, Switchable]) -> None:
    h, dispatcher = harness
    sid = await h.new_session()
    dispatcher.gate = asyncio.Event()
    url = f"{h.url}/sessions/{sid}/v1/chat/completions"
    request = h.http.post(
        url, json={"messages": [{"role": "user", "content": "x"}]}, headers={"X-Rolloutgate-Keepalive": "off"}
    )
    task = asyncio.create_task(request.__aenter__())
    await dispatcher.waiting.wait()
    task.cancel()  # the client gives up and closes its connection
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = h.service.registry.stats
    # the handler checks its client every second (fake seconds: no real time passes)
    await wait_until(lambda: stats().turns_abandoned_total > 0, "the handler saw its client leave")
    assert (stats().turns_abandoned_total, stats().turns_in_flight, stats().records) == (1, 0, 0)


async def test_miles_error_shape_writes_the_session_servers_own_errors_as_miles_does(
    renderer: ChatRenderer,
) -> None:
    """`{"error": "<message>"}` for what the session server itself refuses (miles' clients read the string)."""
    h, server, _ = await start(renderer, ["x"], error_shape="miles")
    try:
        async with h.http.get(f"{h.url}/sessions/nonexistent") as response:
            assert response.status == 404
            assert await response.json() == {"error": "session not found: session_id=nonexistent"}
        sid = await h.new_session()
        async with h.http.post(f"{h.url}/sessions/{sid}/v1/chat/completions", data=b"{not json") as response:
            assert response.status == 400
            assert (await response.json())["error"].startswith("invalid JSON body:")
    finally:
        await h.http.close()
        await server.close()
