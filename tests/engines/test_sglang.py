"""The SGLang adapter against a fake SGLang over loopback HTTP (engines/sglang.py)."""

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
from rolloutgate.engines.http import ControlTimeouts
from rolloutgate.engines.sglang import FIRST_AND_LAST, SglangClient, sglang_capacity
from tests.engines.started import collect as collect_events
from tests.engines.started import stream
from tests.sim.helpers import wait_until

from .fakes import (
    FakeEngine,
    json_reply,
    models_answer,
    serve_like_miles_mock,
    sglang_chat_chunk,
    sglang_chat_stream,
    sglang_generate_chunks,
    sglang_server_info,
    sse_reply,
)

# The fake engine's delays (a slow health check, a long prefill) and the bounded waits are the loop's time: on a
# fake-time loop they pass when the loop is idle, at no real cost, and a timeout is exact.
pytestmark = pytest.mark.looptime


@pytest.fixture
def client(fake: FakeEngine, session: aiohttp.ClientSession) -> SglangClient:
    return SglangClient(fake.url + "/", session, timeouts=ControlTimeouts(health_s=2, pause_s=5))


def call(route: Route, body: dict[str, Any], *, headers: dict[str, str] | None = None) -> UpstreamCall:
    return UpstreamCall(request_id="gw-1", route=route, body=body, headers=headers or {})


async def collect(client: SglangClient, upstream_call: UpstreamCall) -> list[UpstreamEvent]:
    return await collect_events(client, upstream_call)


# -- /generate ---------------------------------------------------------------------------------------------


async def test_generate_streams_with_rid_and_counts_cumulative_tokens(
    fake: FakeEngine, client: SglangClient
) -> None:
    chunks = sglang_generate_chunks("gw-1", list("abcdefghij"), per_chunk=4)
    fake.on_sse("POST", "/generate", chunks)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    events = await collect(client, call(Route.GENERATE, body, headers={"X-SMG-Routing-Key": "s1"}))
    assert [e.tokens for e in events] == [4, 4, 2]
    assert [e.data for e in events] == chunks
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert all(e.assembly is not None and e.assembly.family is EngineFamily.SGLANG for e in events)
    sent = fake.last("/generate")
    assert sent.body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "stream_interval": FIRST_AND_LAST},
        "rid": "gw-1",
        "stream": True,
    }
    assert sent.headers["X-SMG-Routing-Key"] == "s1"
    assert body == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }  # not mutated


LAST = FIRST_AND_LAST


@pytest.mark.parametrize(
    ("body", "expected_params"),
    [
        ({"text": "x"}, {"stream_interval": LAST}),  # no sampling params at all
        (
            {"text": "x", "sampling_params": {"stream_interval": 1}},
            {"stream_interval": LAST},
        ),  # not streaming
        ({"text": "x", "stream": True, "sampling_params": {"stream_interval": 2}}, {"stream_interval": 2}),
        ({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3}}, {"max_new_tokens": 3}),
        (
            {"text": ["a", "b"], "sampling_params": [{}, {"top_k": 1}]},
            [{"stream_interval": LAST}, {"top_k": 1, "stream_interval": LAST}],
        ),
    ],
)
async def test_generate_chunk_cadence_is_the_clients_or_first_and_last(
    fake: FakeEngine, client: SglangClient, body: dict[str, Any], expected_params: Any
) -> None:
    fake.on_sse("POST", "/generate", sglang_generate_chunks("gw-1", ["a"]))
    await collect(client, call(Route.GENERATE, body))
    sent = fake.last("/generate").body
    assert sent.get("sampling_params") == expected_params
    assert sent["stream"] is True


async def test_generate_batch_stream_counts_per_index(fake: FakeEngine, client: SglangClient) -> None:
    a = sglang_generate_chunks("gw-1_0", list("abc"), index=0)
    b = sglang_generate_chunks("gw-1_1", list("xy"), index=1)
    fake.on_sse("POST", "/generate", [a[0], b[0], a[1], b[1], a[2]])
    events = await collect(client, call(Route.GENERATE, {"text": ["p", "q"]}))
    assert sum(e.tokens for e in events) == 5


async def test_generate_error_frame_raises_with_the_engines_verdict(
    fake: FakeEngine, client: SglangClient
) -> None:
    error = b'{"error":{"message":"Duplicate request ID","type":"invalid_request_error","code":400,"retryable":false}}'
    fake.on_sse("POST", "/generate", [*sglang_generate_chunks("gw-1", ["a"], finish="stop")[:0], error])
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.GENERATE, {"text": "x"}))
    assert (caught.value.status, caught.value.retryable, caught.value.body) == (400, False, error)


async def test_generate_reset_mid_stream_is_retryable_after_the_first_events(
    fake: FakeEngine, client: SglangClient
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_reply(request, sglang_generate_chunks("gw-1", list("abcd")), reset_after=2)

    fake.on("POST", "/generate", handler)
    seen: list[UpstreamEvent] = []
    with pytest.raises(UpstreamError) as caught:
        async for event in stream(client, call(Route.GENERATE, {"text": "x"})):
            seen.append(event)
    assert len(seen) == 2
    assert caught.value.retryable and caught.value.status is None


async def test_generate_answered_without_streaming_is_one_whole_body(
    fake: FakeEngine, client: SglangClient
) -> None:
    answer = [
        {"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1}},
        {"text": "bc", "output_ids": [2, 3], "meta_info": {"completion_tokens": 2}},
    ]
    fake.on_json("POST", "/generate", answer)
    (event,) = await collect(client, call(Route.GENERATE, {"text": ["p", "q"]}))
    assert event.is_whole_body and event.tokens == 3 and event.json() == answer


async def test_generate_garbage_event_is_retryable(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_sse("POST", "/generate", [b"<html>Bad Gateway</html>"])
    with pytest.raises(UpstreamError, match="not a JSON object") as caught:
        await collect(client, call(Route.GENERATE, {"text": "x"}))
    assert caught.value.retryable


@pytest.mark.parametrize(("status", "retryable"), [(400, False), (503, True), (500, True)])
async def test_generate_http_errors(
    fake: FakeEngine, client: SglangClient, status: int, retryable: bool
) -> None:
    payload = {"error": {"message": "The request queue is full."}}
    fake.on_json("POST", "/generate", payload, status=status)
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.GENERATE, {"text": "x"}))
    assert (caught.value.status, caught.value.retryable) == (status, retryable)
    assert orjson.loads(caught.value.body or b"") == payload
    assert "queue is full" in caught.value.message


async def test_closing_the_iterator_closes_the_upstream_connection(
    fake: FakeEngine, client: SglangClient
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse_reply(request, sglang_generate_chunks("gw-1", list("ab")), hold=True)

    fake.on("POST", "/generate", handler)
    events = stream(client, call(Route.GENERATE, {"text": "x"}))
    async with events:
        first = await anext(events)
        assert first.tokens == 1
    await wait_until(lambda: fake.disconnects, "the engine saw its client leave")
    assert fake.disconnects == ["/generate"]


# -- OpenAI routes -----------------------------------------------------------------------------------------


async def test_chat_streams_with_rid_and_usage_marks_the_usage_frame_gateway_only(
    fake: FakeEngine, client: SglangClient
) -> None:
    chunks = sglang_chat_stream("gw-1", ["Hi", " there"])
    fake.on_sse("POST", "/v1/chat/completions", chunks)
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = await collect(client, call(Route.CHAT, body))
    assert [e.data for e in events] == chunks
    assert [e.tokens for e in events] == [0, 1, 1, 0, 0]  # role chunk, two words, finish chunk, usage
    assert [e.is_gateway_only for e in events] == [False] * 4 + [True]
    assert [e.finish_reason for e in events] == [None, None, None, "stop", None]
    assert fake.last("/v1/chat/completions").body == {
        **body,
        "rid": "gw-1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_a_non_streaming_clients_chat_is_sent_as_it_came_with_the_rid(
    fake: FakeEngine, client: SglangClient
) -> None:
    whole = {
        "id": "gw-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    fake.on_json("POST", "/v1/chat/completions", whole)
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    (event,) = await collect(client, call(Route.CHAT, body))
    assert event.is_whole_body and event.tokens == 2
    assert fake.last("/v1/chat/completions").body == {**body, "rid": "gw-1"}


async def test_chat_usage_frame_is_forwarded_when_the_streaming_client_asked(
    fake: FakeEngine, client: SglangClient
) -> None:
    fake.on_sse("POST", "/v1/chat/completions", sglang_chat_stream("gw-1", ["a"]))
    body = {
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    events = await collect(client, call(Route.CHAT, body))
    assert not any(e.is_gateway_only for e in events)
    assert fake.last("/v1/chat/completions").body["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }


@pytest.mark.parametrize("flag", ["return_meta_info", "return_token_ids", "return_prompt_token_ids"])
async def test_chat_that_sglang_cannot_stream_runs_non_streamed(
    fake: FakeEngine, client: SglangClient, flag: str
) -> None:
    whole = {
        "id": "gw-1",
        "object": "chat.completion",
        "created": 1,
        "model": "qwen",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5},
        "metadata": {"weight_version": "v7"},
    }
    fake.on_json("POST", "/v1/chat/completions", whole)
    events = await collect(client, call(Route.CHAT, {"messages": [], flag: True}))
    assert len(events) == 1
    assert events[0].is_whole_body and events[0].tokens == 5 and events[0].finish_reason == "stop"
    assert events[0].json() == whole
    sent = fake.last("/v1/chat/completions").body
    assert sent == {"messages": [], flag: True, "rid": "gw-1"}


async def test_chat_that_sglang_cannot_stream_but_the_client_streams_gets_the_engines_400(
    fake: FakeEngine, client: SglangClient
) -> None:
    refusal = {
        "object": "error",
        "message": "return_meta_info is not supported with streaming",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    fake.on_json("POST", "/v1/chat/completions", refusal, status=400)
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.CHAT, {"messages": [], "return_meta_info": True, "stream": True}))
    assert (caught.value.status, caught.value.retryable) == (400, False)
    assert fake.last("/v1/chat/completions").body["stream"] is True


async def test_chat_headers_at_first_token(fake: FakeEngine, client: SglangClient) -> None:
    # a long queue and prefill, past every control limit: a generation has no limit but its connect phase
    prefill_s = 30.0

    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(prefill_s)  # SGLang withholds the status line until the first token
        return await sse_reply(request, sglang_chat_stream("gw-1", ["x"]))

    fake.on("POST", "/v1/chat/completions", handler)
    loop = asyncio.get_running_loop()
    started = loop.time()
    events = await collect(client, call(Route.CHAT, {"messages": []}))
    assert sum(e.tokens for e in events) == 1
    assert loop.time() - started >= prefill_s


async def test_chat_mid_stream_error_frame(fake: FakeEngine, client: SglangClient) -> None:
    error = b'{"error":{"object":"error","message":"Aborted: KV cache full","type":"InternalServerError","param":null,"code":503}}'
    fake.on_sse(
        "POST",
        "/v1/chat/completions",
        [sglang_chat_chunk("gw-1", {"role": "assistant", "content": ""}), error],
    )
    with pytest.raises(UpstreamError) as caught:
        await collect(client, call(Route.CHAT, {"messages": []}))
    assert (caught.value.status, caught.value.retryable) == (503, True)


async def test_completions_stream_even_with_return_token_ids(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_sse(
        "POST", "/v1/completions", [b'{"id":"gw-1","choices":[{"index":0,"text":"a","token_ids":[5]}]}']
    )
    body = {"prompt": "p", "return_token_ids": True, "stream": True}
    await collect(client, call(Route.COMPLETIONS, body))
    sent = fake.last("/v1/completions").body
    assert sent["stream"] is True and sent["rid"] == "gw-1" and sent["return_token_ids"] is True


# -- control -----------------------------------------------------------------------------------------------


async def test_abort_posts_the_rid_and_never_raises(
    fake: FakeEngine, client: SglangClient, session: aiohttp.ClientSession
) -> None:
    fake.on_json("POST", "/abort_request", None)
    await client.abort("gw-9")
    assert fake.last("/abort_request").body == {"rid": "gw-9"}
    fake.on_json("POST", "/abort_request", {"detail": "boom"}, status=500)
    await client.abort("gw-9")  # logged, not raised
    dead = SglangClient("http://127.0.0.1:9", session)
    await dead.abort("gw-9")


async def test_probe_reads_capacity_models_and_weight_version(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_json("GET", "/server_info", sglang_server_info(per_dp=(48, 48)))
    fake.on_json("GET", "/v1/models", models_answer())
    info = await client.probe()
    assert info.family is EngineFamily.SGLANG
    assert (info.capacity, info.models, info.max_model_len) == (96, ("qwen",), 32768)
    assert (info.chunked_prefill_size, info.weight_version) == (8192, "v7")
    # the weight version reaches the assembler through the events
    fake.on_sse("POST", "/generate", sglang_generate_chunks("gw-1", ["a"]))
    (event,) = await collect(client, call(Route.GENERATE, {"text": "x"}))
    assert event.assembly is not None and event.assembly.weight_version == "v7"


async def test_probe_falls_back_to_get_server_info(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_json(
        "GET", "/get_server_info", {**sglang_server_info(), "internal_states": [], "max_running_requests": 64}
    )
    fake.on_json("GET", "/v1/models", models_answer())
    assert (await client.probe()).capacity == 64


async def test_probe_fails_when_the_engine_does_not_answer(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_json("GET", "/server_info", {"detail": "starting"}, status=503)
    with pytest.raises(UpstreamError) as caught:
        await client.probe()
    assert caught.value.status == 503 and caught.value.retryable


def test_capacity_rules() -> None:
    assert sglang_capacity({"internal_states": [{"effective_max_running_requests_per_dp": 10}]}) == 10
    assert sglang_capacity({"internal_states": [{"other": 1}], "max_running_requests": 7}) == 7
    assert sglang_capacity({"max_running_requests": None}) is None


async def test_health(fake: FakeEngine, client: SglangClient, session: aiohttp.ClientSession) -> None:
    assert not await client.health()  # 404
    fake.on_json("GET", "/health", None)
    assert await client.health()
    fake.on_json("GET", "/health", None, status=503)
    assert not await client.health()

    async def slow(_: web.Request) -> web.StreamResponse:
        await asyncio.sleep(20.0)  # SGLang's own limit on a health check that cannot generate
        return json_reply(None)

    fake.on("GET", "/health", slow)
    impatient = SglangClient(fake.url, session, timeouts=ControlTimeouts(health_s=0.2))
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await impatient.health()  # no answer within health_s
    assert loop.time() - started == pytest.approx(0.2, abs=0.01)  # given up at its limit, not at the answer


async def test_readiness_reads_ready_then_ping(fake: FakeEngine, client: SglangClient) -> None:
    assert await client.readiness() is None  # a version without /ready
    fake.on_json("GET", "/ready", None)
    assert await client.readiness() is Readiness.READY
    fake.on_json("GET", "/ready", None, status=503)
    fake.on_json("GET", "/ping", None)
    assert await client.readiness() is Readiness.PAUSED  # not ready, though healthy: paused
    fake.on_json("GET", "/ping", None, status=503)
    assert await client.readiness() is Readiness.NOT_READY  # marked unhealthy (or starting)


async def test_load_from_v1_loads(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_json(
        "GET",
        "/v1/loads",
        {
            "timestamp": 1.0,
            "version": "0.5.23",
            "loads": [
                {"dp_rank": 0, "num_running_reqs": 5, "num_waiting_reqs": 1},
                {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 0},
            ],
        },
    )
    load = await client.load()  # no /metrics here (a 404: SGLang without --enable-metrics)
    assert (load.running, load.waiting, load.generated_tokens_total, load.snapshot_at) == (8, 1, None, 1.0)
    assert [r.path for r in fake.requests].count("/metrics") == 1
    await client.load()
    assert [r.path for r in fake.requests].count("/metrics") == 1  # learnt once: /v1/loads from then on


async def test_load_prefers_the_token_counter_in_metrics(fake: FakeEngine, client: SglangClient) -> None:
    async def metrics(_: web.Request) -> web.StreamResponse:
        return web.Response(
            text='sglang:num_running_reqs{tp_rank="0"} 4.0\nsglang:num_queue_reqs{tp_rank="0"} 2.0\nsglang:generation_tokens_total{model_name="q"} 1234.0\n'
        )

    fake.on("GET", "/metrics", metrics)
    load = await client.load()
    assert (load.running, load.waiting, load.generated_tokens_total) == (4, 2, 1234.0)


async def test_load_unavailable_raises(fake: FakeEngine, client: SglangClient) -> None:
    with pytest.raises(UpstreamError):
        await client.load()


@pytest.mark.parametrize(
    ("mode", "sent"),
    [("abort", "abort"), ("retract", "retract"), ("in_place", "in_place"), ("keep", "in_place")],
)
async def test_pause_modes(fake: FakeEngine, client: SglangClient, mode: str, sent: str) -> None:
    fake.on_json("POST", "/pause_generation", {"message": "Generation paused successfully.", "status": "ok"})
    await client.pause(mode)
    assert fake.last("/pause_generation").body == {"mode": sent}


async def test_pause_drain_is_the_gateways_job(fake: FakeEngine, client: SglangClient) -> None:
    await client.pause("drain")
    await client.pause("wait")
    assert fake.requests == []
    with pytest.raises(ValueError, match="unknown pause mode"):
        await client.pause("freeze")


async def test_resume_and_update_weights(fake: FakeEngine, client: SglangClient) -> None:
    fake.on_json(
        "POST", "/continue_generation", {"message": "Generation continued successfully.", "status": "ok"}
    )
    await client.resume()
    assert fake.last("/continue_generation").body == {}
    fake.on_json(
        "POST", "/update_weights_from_disk", {"success": True, "message": "ok", "num_paused_requests": 0}
    )
    answer = await client.update_weights(
        "/update_weights_from_disk", {"model_path": "/ckpt/7", "weight_version": "v8"}
    )
    assert answer["success"] is True
    assert fake.last("/update_weights_from_disk").body == {"model_path": "/ckpt/7", "weight_version": "v8"}
    fake.on_json(
        "POST", "/update_weights_from_disk", {"success": False, "message": "no such path"}, status=400
    )
    with pytest.raises(UpstreamError) as caught:
        await client.update_weights("update_weights_from_disk", {"model_path": "/nope"})
    assert caught.value.status == 400 and "no such path" in caught.value.message


async def test_probe_learns_the_vocabulary_the_engine_states_or_its_model_folder_holds(
    fake: FakeEngine, client: SglangClient, tmp_path: Path
) -> None:
    fake.on_json("GET", "/v1/models", models_answer())
    fake.on_json("GET", "/server_info", sglang_server_info())  # model_path "Qwen/Qwen3-8B": not a folder here
    assert (await client.probe()).vocab_size is None
    fake.on_json("GET", "/server_info", {**sglang_server_info(), "vocab_size": 1000})  # as the simulator
    assert (await client.probe()).vocab_size == 1000
    (tmp_path / "config.json").write_bytes(orjson.dumps({"vocab_size": 151_936}))
    fake.on_json("GET", "/server_info", {**sglang_server_info(), "model_path": str(tmp_path)})  # SGLang 0.5.9
    assert (await client.probe()).vocab_size == 151_936


# -- an SGLang-speaking engine without /server_info or /v1/models (miles' MockSGLangServer) -----------------


async def test_a_stand_in_without_server_info_or_models_joins_with_defaults_named(
    fake: FakeEngine, client: SglangClient
) -> None:
    serve_like_miles_mock(fake)
    info = await client.probe()
    assert info.family is EngineFamily.SGLANG
    assert info.missing == ("/server_info", "/v1/models", "load (/metrics, /v1/loads)")
    assert (info.capacity, info.models, info.max_model_len, info.weight_version, info.vocab_size) == (
        None,
        (),
        None,
        None,
        None,
    )
    assert client.reports_load is False
    assert not [r for r in fake.requests if r.method == "POST"], "the probe never generates"


async def test_a_stand_in_that_reports_no_load_gets_every_call_it_can_stream_streamed(
    fake: FakeEngine, client: SglangClient
) -> None:
    """Its events are the only progress the gateway can see: a non-streaming client's `/generate` asks for
    every chunk (not FIRST_AND_LAST), its chat streams with a usage frame; a chat SGLang cannot stream
    (`return_meta_info`) goes as it came. The stand-in answers each with one whole JSON body all the same."""
    serve_like_miles_mock(fake)
    await client.probe()
    (event,) = await collect(client, call(Route.GENERATE, {"input_ids": [1, 2], "sampling_params": {}}))
    assert event.is_whole_body and event.json()["text"] == "4"
    sent = fake.last("/generate").body
    assert sent["stream"] is True and "stream_interval" not in sent["sampling_params"]
    await collect(client, call(Route.CHAT, {"messages": [{"role": "user", "content": "hi"}]}))
    sent = fake.last("/v1/chat/completions").body
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    agent = {"messages": [{"role": "user", "content": "hi"}], "return_meta_info": True}
    (event,) = await collect(client, call(Route.CHAT, agent))
    assert event.is_whole_body and "stream" not in fake.last("/v1/chat/completions").body


async def test_without_server_info_but_with_models_and_load_only_server_info_is_missing(
    fake: FakeEngine, client: SglangClient
) -> None:
    serve_like_miles_mock(fake)
    fake.on_json("GET", "/v1/models", models_answer())
    fake.on_json("GET", "/v1/loads", {"timestamp": 1.0, "loads": [{"num_running_reqs": 0}]})
    info = await client.probe()
    assert (info.missing, info.models, info.max_model_len) == (("/server_info",), ("qwen",), 32768)
    assert client.reports_load is True
    await collect(client, call(Route.GENERATE, {"input_ids": [1], "sampling_params": {}}))
    assert fake.last("/generate").body["sampling_params"]["stream_interval"] == FIRST_AND_LAST


async def test_a_server_without_server_info_generate_or_chat_is_not_taken_for_sglang(
    fake: FakeEngine, client: SglangClient
) -> None:
    fake.on_json("GET", "/health", {"status": "ok"})
    with pytest.raises(UpstreamError, match="does not speak SGLang") as caught:
        await client.probe()
    assert caught.value.retryable
    fake.on_json(
        "POST", "/v1/chat/completions", {}
    )  # a chat-only stand-in named sglang+ (miles' scripted one)
    assert (await client.probe()).missing[:2] == ("/server_info", "/v1/models")
    assert not [r for r in fake.requests if r.method == "POST"], "the probe never generates"


async def test_a_failing_server_info_is_not_taken_for_a_missing_one(
    fake: FakeEngine, client: SglangClient
) -> None:
    serve_like_miles_mock(fake)
    fake.on_json("GET", "/get_server_info", {"detail": "starting"}, status=503)
    fake.on_json("GET", "/server_info", {"detail": "Not Found"}, status=404)
    with pytest.raises(UpstreamError) as caught:
        await client.probe()
    assert caught.value.status == 503
