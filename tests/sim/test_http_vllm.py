"""vLLM flavour: OpenAI routes with X-Request-Id, dev-mode pause/resume/abort, metrics, disconnects."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from .conftest import ClusterFactory
from .helpers import post_json, read_sse, wait_running, wait_until

SCALE = 50.0

# the simulator runs on the loop's time (x SCALE): on a fake-time loop its seconds pass when the loop is idle, so
# "nothing happened" is checked long after it would have happened (LONG_AFTER_S), at no real cost
pytestmark = pytest.mark.looptime
LONG_AFTER_S = 60.0  # simulated seconds: a few-token call, were it let through, is answered in well under one
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}]}


async def test_chat_non_streaming_shape_and_request_id(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    async with session.post(
        cluster.urls[0] + "/v1/chat/completions",
        json=CHAT | {"max_tokens": 7, "return_token_ids": True},
        headers={"X-Request-Id": "abc"},
    ) as response:
        assert response.status == 200
        assert response.headers["X-Request-Id"] == "abc"
        body = await response.json()
    assert body["id"] == "chatcmpl-abc" and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["token_ids"]) == 7 and body["prompt_token_ids"]
    assert body["usage"]["completion_tokens"] == 7
    assert cluster.engines[0].request("abc") is not None  # the engine knows it by the header's id


async def test_completion_id_and_unknown_model_404(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url = cluster.urls[0]
    status, body = await post_json(
        session, url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "request_id": "q"}
    )
    assert status == 200 and body["id"] == "cmpl-q" and body["object"] == "text_completion"
    status, body = await post_json(session, url + "/v1/chat/completions", CHAT | {"model": "nope"})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    status, body = await post_json(session, url + "/v1/chat/completions", CHAT | {"n": 2})
    assert status == 400 and body["error"]["code"] == 400


async def test_streaming_sends_headers_at_once_and_deltas(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    engine = cluster.engines[0]
    engine.set_fault("blackhole")  # accepted, never started: still, headers come at once
    body = CHAT | {
        "max_tokens": 6,
        "stream": True,
        "stream_interval": 3,
        "stream_options": {"include_usage": True},
    }
    async with session.post(
        cluster.urls[0] + "/v1/chat/completions", json=body, headers={"X-Request-Id": "s1"}
    ) as response:
        assert response.status == 200
        engine.clear_faults()
        events = await read_sse(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["id"] == "chatcmpl-s1"
    deltas = [e for e in events[1:-2]]
    assert len(deltas) == 3  # tokens 1, 3, 6
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    assert events[-1] == "[DONE]"


async def test_vllm_aborts_at_once_on_client_disconnect(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=5.0)
    engine = cluster.engines[0]
    task = asyncio.create_task(
        session.post(
            cluster.urls[0] + "/v1/chat/completions",
            json=CHAT | {"max_tokens": 30_000},
            headers={"X-Request-Id": "bye"},
        )
    )
    await wait_running(engine)
    task.cancel()
    gone_at = engine.now()
    await wait_until(lambda: (r := engine.request("bye")) is not None and r.is_finished)
    req = engine.request("bye")
    assert req is not None and req.finished_at is not None and req.finish is not None
    assert req.finish.kind == "abort"
    assert req.finished_at - gone_at < 1.0  # at once (1 s at x5 leaves 200 ms for the loops to notice)


async def test_pause_abort_holds_new_requests_until_resume(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """vLLM 0.32 as measured (docs/e2e.md): a request sent while paused waits and is answered after resume."""
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    async with session.post(url + "/pause?mode=abort") as response:
        assert await response.json() == {"status": "paused"}
    held = asyncio.create_task(post_json(session, url + "/v1/completions", {"prompt": "b", "max_tokens": 2}))
    await wait_until(lambda: engine.waiting_count == 1)
    assert not held.done()
    async with session.post(url + "/resume") as response:
        assert await response.json() == {"status": "resumed"}
    status, body = await held
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def test_pause_abort_refuses_new_requests_with_503_when_configured(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """vLLM 0.33's documented behaviour, behind `vllm_reject_while_paused`."""
    cluster = await make_cluster(api="vllm", time_scale=SCALE, vllm_reject_while_paused=True)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(session, url + "/v1/completions", {"prompt": "a", "max_tokens": 20_000})
    )
    await wait_running(engine)
    async with session.post(url + "/pause?mode=abort") as response:
        assert await response.json() == {"status": "paused"}
    status, body = await inflight
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
    status, body = await post_json(session, url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
    assert status == 503 and body["error"]["code"] == 503
    async with session.get(url + "/is_paused") as response:
        assert await response.json() == {"is_paused": True}
    async with session.post(url + "/resume") as response:
        assert await response.json() == {"status": "resumed"}
    assert (await post_json(session, url + "/v1/completions", {"prompt": "b", "max_tokens": 2}))[0] == 200


async def test_pause_wait_drains_before_answering(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE, vllm_reject_while_paused=True)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(session, url + "/v1/completions", {"prompt": "a", "max_tokens": 300, "request_id": "d"})
    )
    await wait_running(engine)
    pause = asyncio.create_task(session.post(url + "/pause?mode=wait"))
    await wait_until(lambda: engine.paused)
    status, _ = await post_json(session, url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
    assert status == 503
    response = await pause
    async with response:
        assert await response.json() == {"status": "paused"}
    drained = engine.request("d")
    assert drained is not None and drained.completion_tokens == 300 and drained.finish is not None
    assert drained.finish.kind == "length"
    await inflight
    async with session.post(url + "/resume"):
        pass


async def test_pause_keep_queues_new_requests_until_resume(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    async with session.post(url + "/pause?mode=keep"):
        pass
    late = asyncio.create_task(post_json(session, url + "/v1/completions", {"prompt": "b", "max_tokens": 3}))
    await wait_until(lambda: engine.waiting_count == 1)
    await asyncio.sleep(LONG_AFTER_S / SCALE)
    assert not late.done()
    async with session.post(url + "/resume"):
        pass
    assert (await late)[0] == 200


async def test_abort_requests_by_id_prefixed_id_and_all(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    calls = [
        asyncio.create_task(
            post_json(
                session,
                url + "/v1/chat/completions",
                CHAT | {"max_tokens": 20_000},
                headers={"X-Request-Id": rid},
            )
        )
        for rid in ("r1", "r2", "r3")
    ]
    await wait_running(engine, 3)
    _, body = await post_json(session, url + "/abort_requests", {"request_ids": ["r1"]})
    assert body == {"status": "aborted", "aborted": 1}
    _, body = await post_json(session, url + "/abort_requests", {"request_ids": ["chatcmpl-r2"]})
    assert body == {"status": "aborted", "aborted": 1}
    _, body = await post_json(session, url + "/abort_requests", {"request_ids": []})
    assert body == {"status": "aborted", "aborted": 1}
    for call in calls:
        status, answer = await call
        assert status == 200 and answer["choices"][0]["finish_reason"] == "abort"


async def test_health_models_load_metrics_and_weights(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE, weight_update_s=0.5)
    url, engine = cluster.urls[0], cluster.engines[0]
    async with session.get(url + "/health") as response:
        assert response.status == 200
    async with session.get(url + "/v1/models") as response:
        assert (await response.json())["data"][0]["owned_by"] == "vllm"
    inflight = asyncio.create_task(
        post_json(session, url + "/v1/completions", {"prompt": "a", "max_tokens": 20_000})
    )
    await wait_running(engine)
    async with session.get(url + "/load") as response:
        assert await response.json() == {"server_load": 1}
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    assert 'vllm:num_requests_running{model_name="sim-model",engine="0"} 1' in text
    assert "vllm:generation_tokens_total{" in text and "vllm:num_requests_waiting{" in text
    engine.abort_all()
    await inflight
    async with session.get(url + "/metrics") as response:
        assert 'finished_reason="abort"} 1' in await response.text()
    status, body = await post_json(session, url + "/update_weights", {"weight_version": "w7"})
    assert status == 200 and body["weight_version"] == "w7" and engine.weight_version == "w7"
    status, body = await post_json(session, url + "/update_weight_version", {"weight_version": "w8"})
    assert status == 200 and engine.weight_version == "w8"


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_refuse_fault_answers_with_the_flavours_error(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, api: str
) -> None:
    cluster = await make_cluster(api=api, time_scale=SCALE)
    cluster.engines[0].set_fault("refuse")
    status, body = await post_json(
        session, cluster.urls[0] + "/v1/chat/completions", CHAT | {"max_tokens": 2}
    )
    assert status == 503
    if api == "vllm":
        assert body["error"]["code"] == 503
    else:
        assert body["object"] == "error" and body["code"] == 503
    cluster.engines[0].clear_faults("refuse")
    assert (await post_json(session, cluster.urls[0] + "/v1/chat/completions", CHAT | {"max_tokens": 2}))[
        0
    ] == 200


TOKENS = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 5, "ignore_eos": True, "logprobs": 0}}


async def test_tokens_route_answers_ids_and_logprobs_whole_and_streamed_alike(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """`/inference/v1/generate` (vLLM 0.32 token_in_token_out): the same ids and logprobs either way, named
    `generate-tokens-<X-Request-Id>`; the prompt's ids on the first chunk when asked; the usage frame last."""
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url = cluster.urls[0] + "/inference/v1/generate"
    async with session.post(url, json=TOKENS, headers={"X-Request-Id": "w"}) as response:
        assert response.status == 200
        whole = await response.json()
    assert whole["request_id"] == "generate-tokens-w" and whole["output_mode"] == "tokens"
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    assert whole["usage"]["completion_tokens"] == 5 and whole["prompt_token_ids"] is None
    streamed = TOKENS | {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    async with session.post(url, json=streamed, headers={"X-Request-Id": "s"}) as response:
        events = await read_sse(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert chunks[0]["prompt_token_ids"] == TOKENS["token_ids"]
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert {chunk["request_id"] for chunk in chunks} == {"generate-tokens-s"}


async def test_tokens_route_refuses_a_body_without_sampling_params_and_aborts_by_its_name(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url = cluster.urls[0]
    status, body = await post_json(session, url + "/inference/v1/generate", {"token_ids": [1, 2]})
    assert status == 400 and body["error"]["param"] == "sampling_params"
    long_call = TOKENS | {"sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    call = asyncio.create_task(
        post_json(session, url + "/inference/v1/generate", long_call, headers={"X-Request-Id": "long"})
    )
    await wait_running(cluster.engines[0])
    async with session.post(
        url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-long"]}
    ) as response:
        assert response.status == 200 and await response.read() == b""  # vLLM answers it with no body
    status, body = await call
    assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
