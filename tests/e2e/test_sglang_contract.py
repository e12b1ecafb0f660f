"""The SGLang engine itself, without the gateway: what the gateway's SGLang adapter and the simulator's
`--api sglang` mode rely on. Run against real SGLang 0.5.9 these are the facts; run against the simulator (which
states 0.5.23) they check that it agrees, and where the two versions differ each asserts its own version's
behaviour (tests/e2e/sglang_facts.py; docs/simulator.md names the differences)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.harness import EngineSet, scrape, settled, wait_for
from tests.e2e.sglang_facts import facts_for

from rolloutgate.engines.sglang import FIRST_AND_LAST, sglang_capacity

pytestmark = [pytest.mark.e2e, pytest.mark.api("sglang")]

PROMPT_IDS = [10, 20, 30, 40, 50]  # inside the tiny model's vocabulary (2,048 ids)
# ~300 tok/s for one stream on real 0.5.9 here: LONG outlasts anything a test waits for (and is aborted),
# MEDIUM runs a few seconds and is waited for.
LONG = 7000
MEDIUM = 1500
# A pause answers before the decode step in flight has landed (retract, 0.5.9: one more token seen after it):
# a frozen counter is read from this long after the pause on.


def rid() -> str:
    return f"e2e-{uuid.uuid4().hex[:12]}"


def generate_body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0},
        **extra,
    }


def data_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def generate_stream(
    url: str, body: dict[str, Any], started: asyncio.Event | None = None
) -> tuple[int, list[dict[str, Any]], bool]:
    """A streamed `/generate`: (status, every data chunk, whether `[DONE]` ended it); `started` is set at the
    first chunk (the engine runs it)."""
    chunks: list[dict[str, Any]] = []
    done = False
    async with (
        httpx.AsyncClient(timeout=120.0) as client,
        client.stream("POST", url + "/generate", json={**body, "stream": True}) as response,
    ):
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(orjson.loads(line[len("data: ") :]))
                if started is not None:
                    started.set()
    return response.status_code, chunks, done


async def start_streams(
    url: str, n: int, max_new_tokens: int
) -> tuple[list[asyncio.Task[tuple[int, list[dict[str, Any]], bool]]], list[str]]:
    """`n` streamed `/generate` calls with their rids, returned once each has produced a token."""
    rids = [rid() for _ in range(n)]
    events = [asyncio.Event() for _ in range(n)]
    tasks = [
        asyncio.create_task(generate_stream(url, generate_body(max_new_tokens, rid=r), e))
        for r, e in zip(rids, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60.0)
    assert not any(t.done() for t in tasks), "a call ended before all had started: make it longer"
    return tasks, rids


def final_meta(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(chunks[-1]["meta_info"])


async def test_metrics_have_the_names_the_gateway_reads(engines: EngineSet) -> None:
    metrics = await scrape(engines.urls[0])
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
        "sglang:prompt_tokens_total",
        "sglang:token_usage",
        "sglang:gen_throughput",
    ):
        assert name in metrics.names(), name
    assert metrics.queued_over(1.0) >= 0  # sglang:queue_time_seconds with a 1.0 s bucket


async def test_generation_counter_counts_at_the_finish_the_decode_counter_live(engines: EngineSet) -> None:
    """`sglang:generation_tokens_total` takes a request's tokens when it finishes; `realtime_tokens_total`
    {mode="decode"} moves while it runs: the gateway reads the latter for engine-level progress."""
    url = engines.urls[0]
    tasks, rids = await start_streams(url, 1, LONG)
    try:
        first = await scrape(url)
        await asyncio.sleep(1.5)
        second = await scrape(url)
        assert second.progress > first.progress, "the decode counter stood still while a call ran"
        assert second.generated == first.generated, "generation_tokens_total moved before any call finished"
    finally:
        async with httpx.AsyncClient(timeout=30.0) as client:
            await client.post(url + "/abort_request", json={"rid": rids[0]})
    _, chunks, _ = await asyncio.wait_for(tasks[0], 30.0)
    done = await wait_for(
        "the aborted call counted", lambda: scrape(url), lambda m: m.generated > second.generated, 10.0
    )
    assert done.generated - second.generated == final_meta(chunks)["completion_tokens"]


async def test_server_info_states_capacity_context_and_version(engines: EngineSet) -> None:
    async with httpx.AsyncClient(timeout=30.0) as client:
        info = (await client.get(engines.urls[0] + "/server_info")).json()
        models = (await client.get(engines.urls[0] + "/v1/models")).json()
    assert sglang_capacity(info) == engines.max_num_seqs
    assert info["max_running_requests"] == engines.max_num_seqs
    assert info["context_length"] == engines.max_model_len
    assert isinstance(info["weight_version"], str)
    assert info["version"] == engines.version
    facts_for(engines.version)  # a version the suite knows
    assert models["data"][0]["id"] == engines.model
    assert models["data"][0]["max_model_len"] == engines.max_model_len


async def test_generate_token_ids_with_logprobs(engines: EngineSet) -> None:
    """TITO: token ids in, token ids and their logprobs out, named by the caller's rid."""
    facts = facts_for(engines.version)
    name = rid()
    async with httpx.AsyncClient(timeout=60.0) as client:
        response = await client.post(
            engines.urls[0] + "/generate", json=generate_body(8, rid=name, return_logprob=True)
        )
    assert response.status_code == 200
    answer = response.json()
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == 8 and isinstance(answer["text"], str)
    assert meta["id"] == name
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT_IDS), 8)
    assert isinstance(meta["cached_tokens"], int) and isinstance(meta["weight_version"], str)
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == answer["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0.0 and text is None for lp, _, text in logprobs)
    assert meta["input_token_logprobs"] == facts.default_input_logprobs(PROMPT_IDS)
    # 0.5.9 counts retractions in "total_retractions", 0.5.23 in "num_retractions"
    assert meta[facts.retractions_key] == 0
    other = {"total_retractions", "num_retractions"} - {facts.retractions_key}
    assert not other & set(meta), f"SGLang {engines.version} has no {other}"


async def test_generate_stream_is_cumulative_and_ends_with_done(engines: EngineSet) -> None:
    status, chunks, done = await generate_stream(engines.urls[0], generate_body(6, return_logprob=True))
    assert status == 200 and done
    ids = [c["output_ids"] for c in chunks]
    assert len(ids) >= 2 and len(ids[-1]) == 6
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert final_meta(chunks)["finish_reason"] == {"type": "length", "length": 6}
    assert len(final_meta(chunks)["output_token_logprobs"]) == 6


async def test_stream_interval_first_and_last_gives_two_chunks(engines: EngineSet) -> None:
    """The gateway's setting for a client that does not stream: the first token, then the whole answer."""
    body = generate_body(40)
    body["sampling_params"]["stream_interval"] = FIRST_AND_LAST
    status, chunks, done = await generate_stream(engines.urls[0], body)
    assert status == 200 and done
    assert [len(c["output_ids"]) for c in chunks] == [1, 40]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_chat_accepts_any_model_name_and_states_the_weight_version(
    engines: EngineSet, stream: bool
) -> None:
    body: dict[str, Any] = {
        "model": "no-such-model",  # SGLang serves one model and does not check the name
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 6,
        "ignore_eos": True,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=60.0) as client:
        response = await client.post(engines.urls[0] + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    if not stream:
        answer = response.json()
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["finish_reason"] == "length"
        assert isinstance(answer["metadata"]["weight_version"], str)
        return
    events = data_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"


async def test_abort_by_rid_ends_the_call_with_its_tokens_so_far(engines: EngineSet) -> None:
    url = engines.urls[0]
    tasks, rids = await start_streams(url, 1, LONG)
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(url + "/abort_request", json={"rid": rids[0]})
    assert response.status_code == 200 and response.content == b""
    status, chunks, done = await asyncio.wait_for(tasks[0], 30.0)
    assert status == 200 and done
    meta = final_meta(chunks)
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < LONG
    assert len(chunks[-1]["output_ids"]) == meta["completion_tokens"]


async def test_abort_all_ends_every_stream_with_a_final_chunk_and_done(engines: EngineSet) -> None:
    url = engines.urls[0]
    tasks, _ = await start_streams(url, 2, LONG)
    async with httpx.AsyncClient(timeout=30.0) as client:
        assert (await client.post(url + "/abort_request", json={"abort_all": True})).status_code == 200
    for status, chunks, done in await asyncio.wait_for(asyncio.gather(*tasks), 30.0):
        assert status == 200 and done
        assert final_meta(chunks)["finish_reason"]["type"] == "abort"
        assert 0 < final_meta(chunks)["completion_tokens"] < LONG


async def test_pause_abort_ends_running_work_then_holds_new_calls(engines: EngineSet) -> None:
    url = engines.urls[0]
    tasks, _ = await start_streams(url, 2, LONG)
    async with httpx.AsyncClient(timeout=60.0) as client:
        paused = await client.post(url + "/pause_generation", json={"mode": "abort"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        try:
            for status, chunks, done in await asyncio.wait_for(asyncio.gather(*tasks), 20.0):
                assert status == 200 and done  # not an HTTP error: a short answer that says abort
                assert final_meta(chunks)["finish_reason"]["type"] == "abort"
                assert 0 < final_meta(chunks)["completion_tokens"] < LONG
            late = asyncio.create_task(client.post(url + "/generate", json=generate_body(8)))
            await asyncio.sleep(1.5)
            assert not late.done(), "a call sent while paused was answered"
        finally:
            resumed = await client.post(url + "/continue_generation", json={})
        assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
        answer = await asyncio.wait_for(late, 30.0)
    assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 8


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_holds_running_work_until_continue(engines: EngineSet, mode: str) -> None:
    """retract frees the KV and prefills again after continue (one retraction); in_place keeps it (none). Both
    generate nothing meanwhile and finish the whole answer."""
    facts = facts_for(engines.version)
    url = engines.urls[0]
    tasks, _ = await start_streams(url, 2, MEDIUM)
    async with httpx.AsyncClient(timeout=60.0) as client:
        assert (await client.post(url + "/pause_generation", json={"mode": mode})).status_code == 200
        try:
            first = (await settled([url]))[url]
            await asyncio.sleep(1.5)
            second = await scrape(url)
            assert second.progress == first.progress, "generation went on while paused"
            assert not any(t.done() for t in tasks), "a held call ended while paused"
        finally:
            await client.post(url + "/continue_generation", json={})
    for status, chunks, done in await asyncio.wait_for(asyncio.gather(*tasks), 60.0):
        assert status == 200 and done
        meta = final_meta(chunks)
        assert meta["finish_reason"] == {"type": "length", "length": MEDIUM}
        assert meta[facts.retractions_key] == (1 if mode == "retract" else 0)


async def test_while_paused_the_control_plane_answers_and_health_hangs(engines: EngineSet) -> None:
    """What the gateway can read from a paused SGLang: `/health` generates a token, so it hangs; the control
    plane answers at once; the pause flag is `/ready` 503 where the version has `/ready`."""
    facts = facts_for(engines.version)
    url = engines.urls[0]
    async with httpx.AsyncClient(timeout=30.0) as client:
        ready_before = (await client.get(url + "/ready")).status_code
        assert ready_before == (200 if facts.has_ready else 404)
        assert (await client.post(url + "/pause_generation", json={"mode": "in_place"})).status_code == 200
        try:
            with pytest.raises(httpx.TimeoutException):
                await client.get(url + "/health", timeout=3.0)
            for path in ("/server_info", "/v1/models", "/metrics", "/model_info"):
                assert (await client.get(url + path, timeout=5.0)).status_code == 200, path
            assert (await client.get(url + "/ping", timeout=5.0)).status_code == 200
            ready_paused = (await client.get(url + "/ready", timeout=5.0)).status_code
            assert ready_paused == (503 if facts.has_ready else 404)
        finally:
            await client.post(url + "/continue_generation", json={})
        await wait_for(
            "/health after continue",
            lambda: client.get(url + "/health", timeout=20.0),
            lambda r: r.status_code == 200,
            30.0,
        )


async def test_flush_cache_when_idle(engines: EngineSet) -> None:
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(engines.urls[0] + "/flush_cache")
    assert response.status_code == 200
    assert response.text.startswith("Cache flushed.")


async def test_weight_version_update_shows_in_model_info_and_meta_info(engines: EngineSet) -> None:
    url, version = engines.urls[0], f"e2e-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(url + "/update_weight_version", json={"new_version": version})
        assert response.status_code == 200
        assert response.json()["success"] is True
        assert response.json()["new_version"] == version
        assert (await client.get(url + "/model_info")).json()["weight_version"] == version
        answer = (await client.post(url + "/generate", json=generate_body(2))).json()
    assert answer["meta_info"]["weight_version"] == version


async def test_load_routes(engines: EngineSet) -> None:
    """`/get_load` answers on both; `/v1/loads` answers 500 on 0.5.9 (its handler does not work with the
    fastapi 0.5.9's pins resolve to), 200 on 0.5.23."""
    facts = facts_for(engines.version)
    # one connection each: 0.5.9's 500 is an exception in the ASGI app (starlette 1.10: "'_IncludedRouter'
    # object has no attribute 'path'"), after which uvicorn closes the connection
    async with httpx.AsyncClient(timeout=30.0) as client:
        loads = await client.get(engines.urls[0] + "/v1/loads")
    async with httpx.AsyncClient(timeout=30.0) as client:
        get_load = await client.get(engines.urls[0] + "/get_load")
    assert loads.status_code == facts.loads_status
    assert get_load.status_code == 200
    assert {"num_reqs", "num_waiting_reqs", "ts_tic"} <= set(get_load.json()[0])
