"""The generic OpenAI-compatible adapter (engines/openai_compat.py)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from rolloutgate.engines.base import EngineFamily, Route, UpstreamCall, UpstreamError
from rolloutgate.engines.openai_compat import OpenAICompatClient
from tests.engines.started import stream

from .fakes import FakeEngine, models_answer


@pytest.fixture
def client(fake: FakeEngine, session: aiohttp.ClientSession) -> OpenAICompatClient:
    return OpenAICompatClient(fake.url, session)


async def test_generate_streams_and_assembles(fake: FakeEngine, client: OpenAICompatClient) -> None:
    chunks = [
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}',
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}',
    ]
    fake.on_sse("POST", "/v1/chat/completions", chunks, crlf=True)
    upstream = UpstreamCall(request_id="gw-3", route=Route.CHAT, body={"messages": [], "stream": True})
    events = [e async for e in stream(client, upstream)]
    assert [e.tokens for e in events] == [0, 1, 0]
    assert events[-1].is_gateway_only
    sent = fake.last("/v1/chat/completions")
    assert "rid" not in sent.body and "X-Request-Id" not in sent.headers
    assert sent.body["stream"] is True


async def test_a_server_that_ignores_stream_answers_whole(
    fake: FakeEngine, client: OpenAICompatClient
) -> None:
    whole = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "length"}],
        "usage": {"completion_tokens": 4},
    }
    fake.on_json("POST", "/v1/chat/completions", whole)
    (event,) = [e async for e in stream(client, UpstreamCall(request_id="gw-3", route=Route.CHAT, body={}))]
    assert event.is_whole_body and event.tokens == 4 and event.finish_reason == "length"


async def test_a_200_error_body_or_garbage_raises(fake: FakeEngine, client: OpenAICompatClient) -> None:
    fake.on_json("POST", "/v1/completions", {"error": {"message": "model not loaded", "code": 500}})
    with pytest.raises(UpstreamError, match="model not loaded") as caught:
        [e async for e in stream(client, UpstreamCall(request_id="gw-3", route=Route.COMPLETIONS, body={}))]
    assert caught.value.retryable

    async def garbage(_: object) -> object:
        from aiohttp import web

        return web.Response(body=b"\x00\xffnot json", content_type="application/json")

    fake.on("POST", "/v1/completions", garbage)  # type: ignore[arg-type]
    with pytest.raises(UpstreamError, match="not JSON") as caught:
        [e async for e in stream(client, UpstreamCall(request_id="gw-3", route=Route.COMPLETIONS, body={}))]
    assert caught.value.retryable


async def test_generate_route_and_pause_are_refused(client: OpenAICompatClient) -> None:
    with pytest.raises(UpstreamError) as caught:
        [e async for e in stream(client, UpstreamCall(request_id="x", route=Route.GENERATE, body={}))]
    assert (
        caught.value.status == 400
        and orjson.loads(caught.value.body or b"")["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(UpstreamError, match="no pause API"):
        await client.pause("abort")
    with pytest.raises(UpstreamError, match="no pause API"):
        await client.resume()
    with pytest.raises(UpstreamError, match="no load"):
        await client.load()


async def test_abort_sends_nothing(fake: FakeEngine, client: OpenAICompatClient) -> None:
    await client.abort("gw-3")
    assert fake.requests == []


async def test_probe_and_health(fake: FakeEngine, client: OpenAICompatClient) -> None:
    assert not await client.health()
    fake.on_json("GET", "/v1/models", models_answer(owner="me"))
    assert await client.health()  # no /health: /v1/models answers
    info = await client.probe()
    assert (info.family, info.capacity, info.models) == (EngineFamily.OPENAI, None, ("qwen",))


async def test_a_non_streaming_clients_call_streams_too_for_want_of_a_load_signal(
    fake: FakeEngine, client: OpenAICompatClient
) -> None:
    """A generic server reports no load, so engine-level progress cannot watch a whole-body call: its own
    stream is the signal, and the driver does not put it under the engine watch (`reports_load`)."""
    chunks = [
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":"stop"}]}',
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}',
    ]
    fake.on_sse("POST", "/v1/chat/completions", chunks)
    events = [
        e
        async for e in stream(
            client, UpstreamCall(request_id="gw-4", route=Route.CHAT, body={"messages": []})
        )
    ]
    assert [e.tokens for e in events] == [1, 0] and events[-1].is_gateway_only
    sent = fake.last("/v1/chat/completions").body
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert client.reports_load is False
