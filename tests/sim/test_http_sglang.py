"""SGLang flavour: the shapes of every endpoint, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import itertools
import math

import aiohttp
import pytest

from rolloutsim import tokens

from .conftest import ClusterFactory
from .helpers import post_json, read_sse, wait_running, wait_until

SCALE = 50.0

# the simulator runs on the loop's time (x SCALE): on a fake-time loop its seconds pass when the loop is idle, so
# "nothing happened" is checked long after it would have happened (LONG_AFTER_S), at no real cost
pytestmark = pytest.mark.looptime
LONG_AFTER_S = 60.0  # simulated seconds: a few-token call, were it let through, is answered in well under one


async def test_generate_text_non_streaming_shape(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    text = "The quick brown fox jumps over the lazy dog."
    status, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"text": text, "rid": "r-1", "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    )
    assert status == 200
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == math.ceil(len(text.encode()) / 4)
    assert meta["completion_tokens"] == 12 == len(body["output_ids"])
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["e2e_latency"] > 0
    assert body["text"] == tokens.decode(body["output_ids"])


async def test_generate_input_ids_with_logprobs(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
    )
    assert status == 200
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 3
    triples = meta["output_token_logprobs"]
    assert len(triples) == 4
    for (logprob, token_id, text), expected_id in zip(triples, body["output_ids"], strict=True):
        assert logprob <= 0 and token_id == expected_id and text is None
    assert meta["input_token_logprobs"] == []
    # same prompt, same seed: same answer
    _, again = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
    )
    assert again["output_ids"] == body["output_ids"]


async def test_batch_scoring_returns_the_prompts_logprobs_from_the_start_asked(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """miles' scoring call: a batch of prompts, no new tokens, `input_token_logprobs` from `logprob_start_len`."""
    cluster = await make_cluster(time_scale=SCALE)
    body = {
        "input_ids": [[5, 6, 7, 8], [9, 10, 11]],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    status, answers = await post_json(session, cluster.urls[0] + "/generate", body)
    assert status == 200 and len(answers) == 2
    for answer, prompt in zip(answers, body["input_ids"], strict=True):
        scored = answer["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in scored] == prompt and scored[0][0] is None
        assert all(t[0] <= 0 for t in scored[1:])
        assert answer["meta_info"]["completion_tokens"] == 0
    _, again = await post_json(session, cluster.urls[0] + "/generate", {**body, "logprob_start_len": 2})
    assert (
        again[0]["meta_info"]["input_token_logprobs"] == answers[0]["meta_info"]["input_token_logprobs"][2:]
    )
    status, _ = await post_json(session, cluster.urls[0] + "/generate", {**body, "logprob_start_len": 3})
    assert status == 400  # at or past the second prompt's length


async def test_generate_streams_cumulative_chunks_every_interval(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    body = {
        "input_ids": [9, 8, 7],
        "sampling_params": {"max_new_tokens": 10, "stream_interval": 4},
        "stream": True,
    }
    async with session.post(cluster.urls[0] + "/generate", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 4, 8, 10]
    for earlier, later in itertools.pairwise(chunks):
        assert later["text"].startswith(earlier["text"])
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]


async def test_incremental_streaming_output_sends_each_chunks_own_tokens(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """`--incremental-streaming-output`: a chunk's text, ids and output logprobs are its own; joined, they are
    the answer the cumulative engine gives, and the counts stay the whole output's."""
    body = {
        "input_ids": [9, 8, 7],
        "sampling_params": {"max_new_tokens": 10, "stream_interval": 4},
        "stream": True,
        "return_logprob": True,
    }
    answers = {}
    for incremental in (False, True):
        cluster = await make_cluster(time_scale=SCALE, incremental_streaming_output=incremental)
        info = await (await session.get(cluster.urls[0] + "/server_info")).json()
        assert info["incremental_streaming_output"] is incremental
        async with session.post(cluster.urls[0] + "/generate", json=body) as response:
            answers[incremental] = (await read_sse(response))[:-1]
    cumulative, incremental_chunks = answers[False], answers[True]
    assert [len(c["output_ids"]) for c in incremental_chunks] == [1, 3, 4, 2]
    assert [c["meta_info"]["completion_tokens"] for c in incremental_chunks] == [1, 4, 8, 10]
    whole = cumulative[-1]
    assert "".join(c["text"] for c in incremental_chunks) == whole["text"]
    assert [i for c in incremental_chunks for i in c["output_ids"]] == whole["output_ids"]
    joined = [lp for c in incremental_chunks for lp in c["meta_info"]["output_token_logprobs"]]
    assert joined == whole["meta_info"]["output_token_logprobs"]
    assert incremental_chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


async def test_generate_batch_returns_a_list(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"text": ["one", "two"], "rid": "b", "sampling_params": {"max_new_tokens": 3}},
    )
    assert status == 200
    assert [item["meta_info"]["id"] for item in body] == ["b_0", "b_1"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"sampling_params": {}}, "text or input_ids"),
        ({"text": "x", "sampling_params": {"n": 2}}, "n > 1"),
        ({"input_ids": [1, -1]}, "token ids"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 10**7}}, "context length"),
    ],
)
async def test_generate_rejects_bad_requests(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, body: dict[str, object], fragment: str
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    status, answer = await post_json(session, cluster.urls[0] + "/generate", body)
    assert status == 400
    assert fragment in answer["error"]["message"]


async def test_duplicate_rid_in_flight_is_a_400(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url = cluster.urls[0] + "/generate"
    first = asyncio.create_task(
        post_json(session, url, {"text": "a", "rid": "dup", "sampling_params": {"max_new_tokens": 500}})
    )
    await wait_running(cluster.engines[0])
    status, body = await post_json(session, url, {"text": "a", "rid": "dup"})
    assert status == 400 and "Duplicate request ID" in body["error"]["message"]
    cluster.engines[0].abort("dup")
    assert (await first)[0] == 200


async def test_chat_completion_shape_with_meta_info(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/v1/chat/completions",
        {
            "model": "anything-goes",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 6,
            "rid": "chat-1",
            "logprobs": True,
            "return_meta_info": True,
        },
    )
    assert status == 200
    assert body["id"] == "chat-1" and body["object"] == "chat.completion"
    assert body["model"] == "anything-goes"  # SGLang accepts any model name
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["content"]) == 6
    meta = choice["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] and meta["completion_tokens"] == 6
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 6
    assert body["metadata"] == {"weight_version": "default"}


async def test_chat_streaming_sends_headers_only_at_first_token(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    engine = cluster.engines[0]
    engine.set_fault("blackhole")  # accepted, queued, never started: no first token until cleared
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pending = asyncio.create_task(session.post(cluster.urls[0] + "/v1/chat/completions", json=chat))
    # /generate streaming answers with headers at once, even while its request is queued
    async with session.post(cluster.urls[0] + "/generate", json={"text": "y", "stream": True}) as queued:
        assert queued.status == 200
        await wait_until(lambda: engine.waiting_count == 2)
        await asyncio.sleep(LONG_AFTER_S / SCALE)
        assert not pending.done()  # the chat stream is queued too: no status line yet
        engine.clear_faults()
        response = await asyncio.wait_for(pending, 10)
        async with response:
            assert response.status == 200
            events = await read_sse(response)
        await read_sse(queued)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2]) != ""
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"


async def test_streaming_chat_rejects_return_meta_info_with_a_flat_error(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "return_meta_info": True},
    )
    assert status == 400
    assert body["object"] == "error" and body["code"] == 400 and "message" in body


async def test_completions_stream_and_non_stream(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url = cluster.urls[0] + "/v1/completions"
    status, body = await post_json(
        session, url, {"prompt": "once upon", "max_tokens": 5, "logprobs": 2, "rid": "c1"}
    )
    assert status == 200 and body["id"] == "c1" and body["object"] == "text_completion"
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 5 and len(lp["top_logprobs"][0]) == 2 and lp["text_offset"][0] == 0
    async with session.post(
        url, json={"prompt": "once upon", "max_tokens": 5, "stream": True, "stream_interval": 2}
    ) as response:
        events = await read_sse(response)
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 4  # tokens 1, 2, 4, 5
    assert "".join(texts) == body["choices"][0]["text"]  # same prompt, same deterministic answer
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_abort_request_messages_prefix_and_abort_all(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, max_running_requests=1)
    url, engine = cluster.urls[0], cluster.engines[0]
    gen = url + "/generate"
    running = asyncio.create_task(
        post_json(session, gen, {"text": "a", "rid": "job-1", "sampling_params": {"max_new_tokens": 20_000}})
    )
    await wait_running(engine)
    waiting = asyncio.create_task(
        post_json(session, gen, {"text": "b", "rid": "job-2", "sampling_params": {"max_new_tokens": 5}})
    )
    await wait_until(lambda: engine.waiting_count == 1)
    # a rid that is not live is ignored, even if it prefixes live ones (SGLang checks the exact rid first)
    assert (await post_json(session, url + "/abort_request", {"rid": "job-"}))[0] == 200
    assert engine.running_count == 1 and engine.waiting_count == 1
    # an exact live rid aborts every rid it prefixes: job-1 prefixes nothing else
    await post_json(session, url + "/abort_request", {"rid": "job-1"})
    status, body = await running
    assert status == 200
    assert body["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert body["meta_info"]["completion_tokens"] > 0
    assert (await waiting)[1]["meta_info"]["finish_reason"]["type"] == "length"
    # abort_all: waiting requests get their own message and no prompt/cached token counts
    blocker = asyncio.create_task(
        post_json(session, gen, {"text": "c", "rid": "x1", "sampling_params": {"max_new_tokens": 20_000}})
    )
    await wait_running(engine)
    queued = asyncio.create_task(post_json(session, gen, {"text": "d", "rid": "x2"}))
    await wait_until(lambda: engine.waiting_count == 1)
    await post_json(session, url + "/abort_request", {"abort_all": True})
    meta = (await queued)[1]["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and "cached_tokens" not in meta
    assert (await blocker)[1]["meta_info"]["finish_reason"]["message"] == "Aborted"


async def test_pause_abort_then_new_requests_wait_until_continue(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "p", "sampling_params": {"max_new_tokens": 20_000}},
        )
    )
    await wait_running(engine)
    status, body = await post_json(session, url + "/pause_generation", {"mode": "abort"})
    assert (status, body) == (200, {"message": "Generation paused successfully.", "status": "ok"})
    aborted = engine.request("p")
    assert aborted is not None and aborted.is_finished  # answered before the pause call returned
    assert (await inflight)[1]["meta_info"]["finish_reason"]["type"] == "abort"
    late = asyncio.create_task(
        post_json(session, url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 3}})
    )
    await asyncio.sleep(LONG_AFTER_S / SCALE)
    assert not late.done() and engine.waiting_count == 0  # blocked before the scheduler, no 503
    status, body = await post_json(session, url + "/continue_generation", {})
    assert body == {"message": "Generation continued successfully.", "status": "ok"}
    assert (await late)[0] == 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_retract_and_in_place_keep_requests_open(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, mode: str
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "keep", "sampling_params": {"max_new_tokens": 300}},
        )
    )
    await wait_until(lambda: (r := engine.request("keep")) is not None and r.completion_tokens > 5)
    await post_json(session, url + "/pause_generation", {"mode": mode})
    frozen = engine.request("keep")
    assert frozen is not None
    made = frozen.completion_tokens
    await asyncio.sleep(LONG_AFTER_S / SCALE)  # 300 tokens take ~3 s
    assert not inflight.done() and frozen.completion_tokens == made
    await post_json(session, url + "/continue_generation", {})
    status, body = await inflight
    assert status == 200 and body["meta_info"]["completion_tokens"] == 300
    assert body["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


async def test_update_weights_waits_for_in_flight_work_and_bumps_the_version(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, weight_update_s=3.0)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "old", "sampling_params": {"max_new_tokens": 200}},
        )
    )
    await wait_running(engine)
    started = engine.now()
    status, body = await post_json(
        session, url + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}
    )
    assert status == 200 and body["success"] is True
    old = engine.request("old")
    assert inflight.done() and old is not None and old.finished_at is not None
    assert engine.now() - old.finished_at >= 3.0 * 0.95  # the update ran only after the request finished
    assert engine.now() - started >= 3.0
    assert (await inflight)[1]["meta_info"]["weight_version"] == "default"
    _, after = await post_json(
        session, url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}
    )
    assert after["meta_info"]["weight_version"] == "v2"
    _, chat = await post_json(
        session,
        url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    )
    assert chat["metadata"]["weight_version"] == "v2"


async def test_update_weights_while_paused_runs_at_once(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, weight_update_s=1.0)
    url, engine = cluster.urls[0], cluster.engines[0]
    inflight = asyncio.create_task(
        post_json(session, url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 20_000}})
    )
    await wait_running(engine)
    await post_json(session, url + "/pause_generation", {"mode": "in_place"})
    status, body = await post_json(
        session, url + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v3"}
    )
    assert status == 200 and body["num_paused_requests"] == 1
    assert not inflight.done()
    await post_json(session, url + "/continue_generation", {})
    engine.abort_all()
    assert (await inflight)[1]["meta_info"]["weight_version"] == "v3"


async def test_flush_cache_health_info_loads_models_metrics(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    async with session.get(url + "/flush_cache") as response:
        assert response.status == 200 and (await response.text()).startswith("Cache flushed.")
    inflight = asyncio.create_task(
        post_json(session, url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 20_000}})
    )
    await wait_running(engine)
    async with session.post(url + "/flush_cache") as response:
        assert response.status == 400
    async with session.get(url + "/health") as response:
        assert response.status == 200
    for path in ("/server_info", "/get_server_info"):
        async with session.get(url + path) as response:
            info = await response.json()
        assert info["max_running_requests"] == 8 and info["chunked_prefill_size"] == 256
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 8
    async with session.get(url + "/v1/loads") as response:
        loads = (await response.json())["loads"][0]
    assert loads["num_running_reqs"] == 1 and loads["max_running_requests"] == 8
    async with session.get(url + "/v1/models") as response:
        models = await response.json()
    assert models["data"][0]["id"] == "sim-model" and models["data"][0]["owned_by"] == "sglang"
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    assert "sglang:num_running_reqs{" in text and "sglang:generation_tokens_total{" in text
    assert (
        'sglang:num_running_reqs{model_name="sim-model",engine_type="unified",tp_rank="0",pp_rank="0"} 1'
        in text
    )
    engine.abort_all()
    await inflight


async def test_health_waits_a_poll_and_fails_on_a_frozen_engine(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=100.0)
    url, engine = cluster.urls[0], cluster.engines[0]
    before = engine.now()
    async with session.get(url + "/health_generate") as response:
        assert response.status == 200
    assert engine.now() - before >= 1.0  # SGLang looks after a 1 s poll
    engine.set_fault("freeze")
    before = engine.now()
    async with session.get(url + "/health") as response:
        assert response.status == 503
    assert engine.now() - before >= 20.0


async def test_sglang_aborts_a_disconnected_request_after_a_lag(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=10.0)
    engine = cluster.engines[0]
    body = {"text": "a", "rid": "gone", "sampling_params": {"max_new_tokens": 30_000}}
    task = asyncio.create_task(session.post(cluster.urls[0] + "/generate", json=body))
    await wait_running(engine)
    task.cancel()
    disconnected_at = engine.now()
    await wait_until(lambda: (r := engine.request("gone")) is not None and r.is_finished)
    req = engine.request("gone")
    assert req is not None and req.finished_at is not None and req.finish is not None
    assert req.finish.kind == "abort"
    lag = req.finished_at - disconnected_at
    assert 0.0 < lag <= engine.config.disconnect_lag_s + 5.0  # at the next sweep (+0.5 s real of slack)
