"""The session API's routes on the gateway (server/session_routes.py), its engine a scripted SGLang over
loopback HTTP: the OpenAI SDK and LiteLLM pointed at `.../sessions/{id}/v1` unchanged, status codes, one
request id from the client to the engine's rid to the record, keep-alive and errors after it (the front's
writer), proxying, the sweeper, API keys, miles' error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from rolloutgate.config import EngineSpec
from rolloutgate.server.app import GatewayServer
from rolloutgate.sessions.render import ChatRenderer
from rolloutgate.sessions.service import SessionCall, SessionService
from tests.engines.fakes import FakeEngine, json_reply, sse_reply
from tests.server.conftest import MakeGateway
from tests.sessions.fixtures import WEATHER_TOOL, ScriptedGenerate, build_tiny_tokenizer
from tests.sim.helpers import wait_until

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KEEPALIVE_S = 0.05  # the gateway's keep-alive interval here
REPLIES = [TOOL_CALL, "It is sunny and 21 degrees.", "Bye."] * 3


@dataclass
class ScriptedEngine:
    """`ScriptedGenerate` (tests/sessions/fixtures.py) served as an SGLang engine with `/generate` and `/health` only
    (admitted with defaults: docs/gateway.md, "Engines as they come"). A test holds its generations at `gate`
    or has them answer `fail` (status, body)."""

    script: ScriptedGenerate
    fake: FakeEngine = field(default_factory=FakeEngine)
    gate: asyncio.Event | None = None
    fail: tuple[int, bytes] | None = None
    waiting: asyncio.Event = field(default_factory=asyncio.Event)
    rids: list[str] = field(default_factory=list)  # the rid of each generation

    @property
    def generations(self) -> int:
        return len(self.rids)

    async def start(self) -> str:
        self.fake.on("POST", "/generate", self._generate)
        self.fake.on_json("GET", "/health", {})
        return await self.fake.start()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.rids.append(str(body.get("rid")))
        if self.gate is not None:
            self.waiting.set()
            await self.gate.wait()
        if self.fail is not None:
            status, payload = self.fail
            return web.Response(status=status, body=payload, content_type="application/json")
        call = SessionCall(
            request_id=str(body.get("rid")), routing_key="", method="POST", path="/generate", body=body
        )
        answer = await self.script(call)
        if body.get("stream"):  # the whole answer as one cumulative chunk
            return await sse_reply(request, [answer.body])
        return json_reply(orjson.loads(answer.body))


@dataclass
class Harness:
    url: str
    gateway: GatewayServer
    engine: ScriptedEngine
    http: httpx.AsyncClient

    @property
    def service(self) -> SessionService:
        service: SessionService = self.gateway.context.extras["sessions"]
        return service

    async def new_session(self) -> str:
        response = await self.http.post(f"{self.url}/sessions")
        assert response.status_code == 200, response.text
        return str(response.json()["session_id"])

    def chat_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1/chat/completions"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
async def start(
    tokenizer_dir: Path, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> AsyncIterator[Any]:
    """`await start(**settings)`: a scripted engine and a gateway in front of it with the session API."""
    engines: list[ScriptedEngine] = []

    async def make(replies: list[str] = REPLIES, **settings: Any) -> Harness:
        engine = ScriptedEngine(ScriptedGenerate(ChatRenderer.from_dir(tokenizer_dir), replies=replies))
        engines.append(engine)
        url = await engine.start()
        settings.setdefault("keepalive_interval", KEEPALIVE_S)
        settings.setdefault("keepalive_non_streaming", True)
        gateway = await make_gateway(
            engines=[EngineSpec(url=url, family="sglang")], tokenizer=str(tokenizer_dir), **settings
        )
        await wait_until(lambda: bool(gateway.context.pool.engines), "the engine joined")
        return Harness(gateway.url, gateway, engine, http)

    yield make
    for engine in engines:
        if engine.gate is not None:
            engine.gate.set()
        await engine.fake.close()


@pytest.fixture
async def harness(start: Any) -> Harness:
    h: Harness = await start()
    return h


async def test_openai_sdk_runs_a_tool_using_agent_unchanged(harness: Harness) -> None:
    h = harness
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

    trajectory = (await h.http.get(f"{h.url}/sessions/{sid}/trajectory")).json()
    seen, produced = h.engine.script.seen_input_ids, h.engine.script.produced_output_ids
    assert trajectory["token_ids"] == seen[-1] + produced[-1]
    assert sum(trajectory["loss_mask"]) == sum(len(p) for p in produced)
    described = (await h.http.get(f"{h.url}/sessions/{sid}")).json()
    assert described["session_id"] == sid and len(described["records"]) == 3
    assert [r["prompt_token_ids"] for r in described["records"]] == seen
    assert (
        "prompt_new_token_ids"
        in (await h.http.get(f"{h.url}/sessions/{sid}?prompt_ids=delta")).json()["records"][1]
    )
    await client.close()


async def test_one_request_id_from_the_client_to_the_engine_and_the_record(harness: Harness) -> None:
    h = harness
    sid = await h.new_session()
    response = await h.http.post(h.chat_url(sid), json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 200, response.text
    request_id = response.headers["X-Rolloutgate-Request-Id"]
    (record,) = (await h.http.get(f"{h.url}/sessions/{sid}")).json()["records"]
    assert h.engine.rids == [f"{request_id}-01"]  # the engine's rid: the id and its attempt
    assert record["request_id"] == request_id
    assert response.headers["X-Rolloutgate-Session-Recorded"] == "true"
    assert response.headers["X-Rolloutgate-Engine"] == h.engine.fake.url
    assert "charged=" in response.headers["X-Rolloutgate-Timing"]


async def test_litellm_runs_against_the_session_url(harness: Harness) -> None:
    litellm = pytest.importorskip("litellm")  # installed by the test extra; import is slow, so once here
    h = harness
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
    seen, produced = h.engine.script.seen_input_ids, h.engine.script.produced_output_ids
    assert seen[1][: len(seen[0]) + len(produced[0])] == seen[0] + produced[0]


async def test_status_codes_and_the_bad_requests_metric(start: Any) -> None:
    h: Harness = await start(session_idle_ttl=60.0)
    sid = await h.new_session()
    url = h.chat_url(sid)
    assert (await h.http.post(url, content=b"{not json")).status_code == 400
    response = await h.http.post(url, json={"messages": [{"role": "user", "content": "x"}], "n": 3})
    assert (response.status_code, response.json()["error"]["code"]) == (400, "unsupported_parameter")
    first = [{"role": "user", "content": "x"}]
    reply = (await h.http.post(url, json={"messages": first})).json()["choices"][0]["message"]
    second = [*first, reply, {"role": "user", "content": "w"}]
    assert (await h.http.post(url, json={"messages": second})).status_code == 200
    # a first message edited under two turns: rolling back both is refused (one turn back at most)
    diverged = [{"role": "user", "content": "y"}, reply, {"role": "user", "content": "z"}]
    response = await h.http.post(url, json={"messages": diverged})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["type"]) == (
        400,
        "session_diverged",
        "invalid_request_error",
    )
    assert error["message"].startswith("rollback failed: discard_count=2 exceeds")
    response = await h.http.get(f"{h.url}/sessions/nope")
    assert (response.status_code, response.json()["error"]["code"]) == (404, "session_not_found")
    metrics = (await h.http.get(f"{h.url}/metrics")).text
    for code in ("invalid_request", "unsupported_parameter", "session_diverged", "session_not_found"):
        assert f'rolloutgate_bad_requests_total{{code="{code}"}} 1.0' in metrics, code
    other = await h.new_session()
    assert (await h.http.delete(f"{h.url}/sessions/{other}")).status_code == 204
    assert (await h.http.delete(f"{h.url}/sessions/{other}")).status_code == 404


@pytest.mark.looptime
async def test_an_idle_session_is_gone_after_its_ttl_and_the_sweeper_evicts_it(start: Any) -> None:
    h: Harness = await start(session_idle_ttl=60.0)
    sid = await h.new_session()
    kept = await h.new_session()
    assert (await h.http.get(f"{h.url}/sessions/{kept}")).status_code == 200
    await asyncio.sleep(61)  # the loop's time (looptime): no real time passes
    response = await h.http.get(f"{h.url}/sessions/{sid}")
    assert (response.status_code, response.json()["error"]["code"]) == (410, "session_gone")
    assert (
        await h.http.post(h.chat_url(sid), json={"messages": [{"role": "user", "content": "x"}]})
    ).status_code == 410
    # the sweeper (every 30 s at most) took the other one without a call to it
    assert h.service.registry.stats().evicted_idle_ttl_total == 2


async def test_keepalive_then_answer(harness: Harness) -> None:
    h = harness
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()
    body = {"messages": [{"role": "user", "content": "x"}]}
    async with h.http.stream("POST", h.chat_url(sid), json=body) as response:
        assert response.status_code == 200  # committed by the first keep-alive byte
        chunks = response.aiter_raw()
        assert (await anext(chunks)).startswith(b" ")
        h.engine.gate.set()
        rest = b"".join([piece async for piece in chunks])
    parsed = orjson.loads(rest)  # leading whitespace is valid JSON
    assert parsed["choices"][0]["message"]["role"] == "assistant"
    assert parsed["rolloutgate_timing"]["engine_id"] == "engine-0"  # the final breakdown, in the body


async def test_streaming_keepalive_then_error_event(start: Any) -> None:
    h: Harness = await start(timeout=1.0)
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()  # held: the gateway's charged-time clock runs out
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    with pytest.raises(openai.APIError, match="timeout"):
        async for _ in stream:
            pass
    await client.close()
    assert h.service.registry.stats().turns_in_flight == 0


async def test_non_streaming_error_after_keepalive_is_the_error_object_then_a_second_value(
    start: Any,
) -> None:
    h: Harness = await start(timeout=1.0)
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()
    response = await h.http.post(h.chat_url(sid), json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 200  # committed by keep-alive; the body ends normally, no cut connection
    body = response.content.lstrip()
    error, end = orjson.loads(body.split(b"\n")[0]), body.split(b"\n", 1)[1]
    assert error["error"]["code"] == "timeout" and end.strip().startswith(b'{"rolloutgate"')


@pytest.mark.parametrize("client", ["openai", "litellm"])
async def test_a_turn_that_fails_after_keepalive_starts_no_second_generation(start: Any, client: str) -> None:
    """RL rollouts' own path: the agent's client, with its retries on, raises once and sends nothing again."""
    h: Harness = await start(timeout=1.0)
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()
    messages = [{"role": "user", "content": "x"}]
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
    assert h.engine.generations == 1  # one generation: no client retried
    assert h.service.registry.stats().turns_in_flight == 0


async def test_an_error_before_keepalive_keeps_its_status(start: Any) -> None:
    h: Harness = await start(keepalive_non_streaming=False)
    sid = await h.new_session()
    h.engine.fail = (400, b'{"object": "error", "message": "context too long"}')
    response = await h.http.post(h.chat_url(sid), json={"messages": [{"role": "user", "content": "x"}]})
    assert (response.status_code, response.json()["message"]) == (400, "context too long")  # the engine's own
    assert h.service.registry.stats().records == 0


async def test_other_paths_take_the_gateways_route_with_the_session_as_routing_key(harness: Harness) -> None:
    h = harness
    sid = await h.new_session()
    response = await h.http.post(
        f"{h.url}/sessions/{sid}/generate", json={"input_ids": [5, 6, 7], "sampling_params": {}}
    )
    assert response.status_code == 200, response.text
    assert h.engine.fake.last("/generate").headers["X-SMG-Routing-Key"] == sid
    assert (await h.http.get(f"{h.url}/sessions/unknown/v1/models")).status_code == 404


async def test_api_keys_guard_every_route(start: Any) -> None:
    h: Harness = await start(api_keys=["good"])
    response = await h.http.post(f"{h.url}/sessions")
    assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
    response = await h.http.post(f"{h.url}/sessions", headers={"Authorization": "Bearer good"})
    sid = response.json()["session_id"]
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="good", max_retries=0)
    answer = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    assert answer.choices[0].message.content == TOOL_CALL  # no tools offered: the text as the model wrote it
    await client.close()


async def test_an_engine_error_after_keepalive_reaches_a_streaming_sdk(harness: Harness) -> None:
    h = harness
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()
    h.engine.fail = (400, b'{"object": "error", "message": "context too long"}')
    client = openai.AsyncOpenAI(base_url=f"{h.url}/sessions/{sid}/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(  # returns at the 200 keep-alive committed
        model="tiny", messages=[{"role": "user", "content": "x"}], stream=True
    )
    h.engine.gate.set()
    with pytest.raises(openai.APIError, match="context too long"):
        async for _ in stream:
            pass
    await client.close()
    assert h.service.registry.stats().records == 0


async def test_a_client_that_leaves_cancels_its_turn(harness: Harness) -> None:
    h = harness
    sid = await h.new_session()
    h.engine.gate = asyncio.Event()
    request = asyncio.create_task(
        h.http.post(h.chat_url(sid), json={"messages": [{"role": "user", "content": "x"}]})
    )
    await h.engine.waiting.wait()
    request.cancel()  # the client gives up and closes its connection
    with pytest.raises(asyncio.CancelledError):
        await request
    stats = h.service.registry.stats
    await wait_until(lambda: stats().turns_abandoned_total > 0, "the gateway saw its client leave")
    assert (stats().turns_abandoned_total, stats().turns_in_flight, stats().records) == (1, 0, 0)


async def test_miles_error_shape_writes_the_session_servers_own_errors_as_miles_does(start: Any) -> None:
    """`{"error": "<message>"}` for what the session server itself refuses (miles' clients read the string)."""
    h: Harness = await start(session_error_shape="miles")
    response = await h.http.get(f"{h.url}/sessions/nonexistent")
    assert response.status_code == 404
    assert response.json() == {"error": "session not found: session_id=nonexistent"}
    sid = await h.new_session()
    response = await h.http.post(h.chat_url(sid), content=b"{not json")
    assert response.status_code == 400 and response.json()["error"].startswith("invalid JSON body:")
