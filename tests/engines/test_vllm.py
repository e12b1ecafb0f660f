"""The vLLM adapter against a fake vLLM over loopback HTTP (engines/vllm.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from rolloutgate.engines.base import (
    EngineFamily,
    Readiness,
    Route,
    UpstreamCall,
    UpstreamError,
    UpstreamEvent,
)
from rolloutgate.engines.vllm import VllmClient, vllm_capacity
from rolloutgate.server.assemble import assemble
from tests.engines.started import collect as collect_events
from tests.engines.started import stream
from tests.sim.helpers import wait_until

from .fakes import FakeEngine, completion_chunk, models_answer, sse_reply, usage_frame, vllm_chat_stream

# the bounded waits are the loop's time: on a fake-time loop they pass when the loop is idle, at no real cost
pytestmark = pytest.mark.looptime


@pytest.fixture
def client(fake: FakeEngine, session: aiohttp.ClientSession) -> VllmClient:
    return VllmClient(fake.url, session)


def call(route: Route, body: dict[str, Any]) -> UpstreamCall:
    return UpstreamCall(request_id="gw-2", route=route, body=body, headers={"x-session-id": "s"})


async def collect(client: VllmClient, upstream_call: UpstreamCall) -> list[UpstreamEvent]:
    return await collect_events(client, upstream_call)


async def test_chat_streams_with_request_id_header_and_usage(fake: FakeEngine, client: VllmClient) -> None:
    chunks = vllm_chat_stream("gw-2", [f"t{i}" for i in range(7)], merged=2)  # the reader lagged: 2 per chunk
    fake.on_sse("POST", "/v1/chat/completions", chunks, pieces=5)
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = await collect(client, call(Route.CHAT, body))
    assert [e.data for e in events] == chunks
    assert sum(e.tokens for e in events) == 7  # four chunks counted one each, the usage frame adds three
    assert events[-1].is_gateway_only
    assert events[-2].finish_reason == "stop"
    sent = fake.last("/v1/chat/completions")
    assert sent.headers["X-Request-Id"] == "gw-2" and sent.headers["x-session-id"] == "s"
    assert sent.body == {**body, "stream": True, "stream_options": {"include_usage": True}}
    answer = orjson.loads(assemble(Route.CHAT, events))
    assert answer["choices"][0]["message"]["content"] == "".join(f"t{i}" for i in range(7))
    assert answer["id"] == "chatcmpl-gw-2" and answer["choices"][0]["stop_reason"] is None


async def test_completions_stream(fake: FakeEngine, client: VllmClient) -> None:
    chunks = [
        completion_chunk("cmpl-gw-2", "a"),
        completion_chunk("cmpl-gw-2", "b", finish="length"),
        usage_frame("cmpl-gw-2", 2, obj="text_completion"),
    ]
    fake.on_sse("POST", "/v1/completions", chunks)
    events = await collect(
        client,
        call(
            Route.COMPLETIONS, {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": True}}
        ),
    )
    assert [e.tokens for e in events] == [1, 1, 0]
    assert not events[-1].is_gateway_only  # the client asked for usage


async def test_generate_is_refused_before_sending(fake: FakeEngine, client: VllmClient) -> None:
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.GENERATE, {"text": "x"}))
    assert (caught.value.status, caught.value.retryable) == (400, False)
    assert "/generate" in caught.value.message
    assert orjson.loads(caught.value.body or b"")["error"]["code"] == 400
    assert fake.requests == []


async def test_paused_engine_503_is_retryable(fake: FakeEngine, client: VllmClient) -> None:
    fake.on_json(
        "POST",
        "/v1/chat/completions",
        {"error": {"message": "engine paused", "type": "ServiceUnavailable", "param": None, "code": 503}},
        status=503,
    )
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.CHAT, {"messages": []}))
    assert (caught.value.status, caught.value.retryable) == (503, True)
    assert "engine paused" in caught.value.message


async def test_closing_the_iterator_is_the_abort(fake: FakeEngine, client: VllmClient) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_reply(request, vllm_chat_stream("gw-2", ["a", "b"]), hold=True)

    fake.on("POST", "/v1/chat/completions", handler)
    events = stream(client, call(Route.CHAT, {"messages": []}))
    async with events:
        await anext(events)
    await wait_until(lambda: fake.disconnects, "the engine saw its client leave")
    assert fake.disconnects == ["/v1/chat/completions"]


async def test_cancelling_the_consumer_closes_the_connection(fake: FakeEngine, client: VllmClient) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_reply(request, vllm_chat_stream("gw-2", ["a"]), hold=True)

    fake.on("POST", "/v1/chat/completions", handler)
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in stream(client, call(Route.CHAT, {"messages": []})):
            first.set()

    task = asyncio.create_task(consume())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: fake.disconnects, "the engine saw its client leave")
    assert fake.disconnects == ["/v1/chat/completions"]


async def test_abort_names_every_id_form_and_tolerates_no_dev_mode(
    fake: FakeEngine, client: VllmClient
) -> None:
    await client.abort("gw-2")  # 404 without VLLM_SERVER_DEV_MODE: no error
    fake.on_json("POST", "/abort_requests", {"status": "aborted", "aborted": 1})
    await client.abort("gw-2")
    ids = ["gw-2", "chatcmpl-gw-2", "cmpl-gw-2", "generate-tokens-gw-2"]
    assert fake.last("/abort_requests").body == {"request_ids": ids}


async def test_readiness_from_is_paused_in_dev_mode_only(fake: FakeEngine, client: VllmClient) -> None:
    assert await client.readiness() is None  # 404 without VLLM_SERVER_DEV_MODE
    fake.on_json("GET", "/is_paused", {"is_paused": True})
    assert await client.readiness() is Readiness.PAUSED
    fake.on_json("GET", "/is_paused", {"is_paused": False})
    assert await client.readiness() is Readiness.READY
    fake.on_json("GET", "/is_paused", {"paused": "yes"})
    assert await client.readiness() is None  # a shape it does not know


async def test_probe_with_and_without_dev_mode(fake: FakeEngine, client: VllmClient) -> None:
    fake.on_json("GET", "/v1/models", models_answer(owner="vllm", max_model_len=4096))
    info = await client.probe()
    assert (info.family, info.capacity, info.models, info.max_model_len) == (
        EngineFamily.VLLM,
        None,
        ("qwen",),
        4096,
    )
    fake.on_json(
        "GET", "/server_info", {"vllm_config": {"scheduler_config": {"max_num_seqs": 256}}, "vllm_env": {}}
    )
    assert (await client.probe()).capacity == 256
    assert fake.last("/server_info").query == {"config_format": "json"}


def test_capacity_from_text_config() -> None:
    text = "model='qwen', scheduler_config=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=128)"
    assert vllm_capacity({"vllm_config": text}) == 128
    assert vllm_capacity({"vllm_config": "nothing here"}) is None
    assert vllm_capacity({"vllm_config": {"model_config": {}}}) is None
    assert vllm_capacity({"max_num_seqs": 32, "max_model_len": 4096}) == 32
    assert vllm_capacity(None) is None


async def test_load_and_health(fake: FakeEngine, client: VllmClient) -> None:
    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(
            text='# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="q",engine="0"} 9.0\n'
            'vllm:num_requests_waiting{model_name="q",engine="0"} 3.0\nvllm:generation_tokens_total{model_name="q",engine="0"} 77.0\n'
        )

    fake.on("GET", "/metrics", metrics)
    load = await client.load()
    assert (load.running, load.waiting, load.generated_tokens_total) == (9, 3, 77.0)
    assert not await client.health()
    fake.on_json("GET", "/health", None)
    assert await client.health()


async def test_load_without_vllm_metrics_raises(fake: FakeEngine, client: VllmClient) -> None:
    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(text="python_gc_objects_collected_total 1\n")

    fake.on("GET", "/metrics", metrics)
    with pytest.raises(UpstreamError):
        await client.load()


@pytest.mark.parametrize(
    ("mode", "sent"),
    [
        ("abort", "abort"),
        ("drain", "wait"),
        ("wait", "wait"),
        ("in_place", "keep"),
        ("keep", "keep"),
        ("retract", "keep"),
    ],
)
async def test_pause_modes(fake: FakeEngine, client: VllmClient, mode: str, sent: str) -> None:
    fake.on_json("POST", "/pause", {"status": "paused"})
    await client.pause(mode)
    assert fake.last("/pause").query == {"mode": sent}


async def test_pause_errors_and_resume(fake: FakeEngine, client: VllmClient) -> None:
    with pytest.raises(ValueError, match="unknown pause mode"):
        await client.pause("nap")
    with pytest.raises(UpstreamError) as caught:
        await client.pause("abort")  # no dev mode: 404
    assert caught.value.status == 404 and not caught.value.retryable
    fake.on_json("POST", "/resume", {"status": "resumed"})
    await client.resume()
    assert fake.last("/resume").method == "POST"


async def test_update_weights_forwards(fake: FakeEngine, client: VllmClient) -> None:
    fake.on_json("POST", "/update_weights", {"status": "ok"})
    assert await client.update_weights("update_weights", {"names": ["w"]}) == {"status": "ok"}
    assert fake.last("/update_weights").body == {"names": ["w"]}


async def test_a_non_streaming_clients_chat_is_sent_as_it_came_and_answered_whole(
    fake: FakeEngine, client: VllmClient
) -> None:
    whole = {
        "id": "chatcmpl-gw-2",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }
    fake.on_json("POST", "/v1/chat/completions", whole)
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    (event,) = await collect(client, call(Route.CHAT, body))
    assert event.is_whole_body and event.tokens == 5 and event.finish_reason == "length"
    assert fake.last("/v1/chat/completions").body == body  # no stream, no stream_options: the direct call


async def test_probe_learns_the_vocabulary_from_the_model_card(
    fake: FakeEngine, client: VllmClient, tmp_path: Path
) -> None:
    card = models_answer(owner="vllm")
    fake.on_json("GET", "/v1/models", card)  # root "qwen": not a folder here
    assert (await client.probe()).vocab_size is None
    (tmp_path / "config.json").write_bytes(orjson.dumps({"vocab_size": 2048}))
    card["data"][0]["root"] = str(tmp_path)  # vLLM names the model's path
    fake.on_json("GET", "/v1/models", card)
    assert (await client.probe()).vocab_size == 2048
    card["data"][0]["vocab_size"] = 1000  # as the simulator states it
    fake.on_json("GET", "/v1/models", card)
    assert (await client.probe()).vocab_size == 1000
