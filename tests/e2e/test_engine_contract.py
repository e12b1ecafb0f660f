"""The engine itself, without the gateway: what the gateway's vLLM adapter and the simulator's `--api vllm`
mode rely on. Run against real vLLM these are the facts; run against the simulator they check that it agrees
(docs/e2e.md lists what was learned where they did not)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.harness import EngineSet, MetricsMonitor, scrape, wait_for

from rolloutgate.engines.vllm import vllm_capacity

pytestmark = [pytest.mark.e2e, pytest.mark.api("vllm")]

PROMPT = "Tell me about the sea."
# Token counts, sized for the tiny model on a 2-core CPU (~280 tok/s alone, ~700 tok/s over 4 streams): LONG
# outlasts anything a test waits for (and is aborted), MEDIUM runs a few seconds and is waited for.
LONG = 7000
MEDIUM = 3000


def body(engines: EngineSet, route: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": engines.model, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if route == "chat":
        base["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        base["prompt"] = PROMPT
    return base


def path(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


async def post(url: str, route: str, payload: dict[str, Any], **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120.0) as client:
        return await client.post(url + path(route), json=payload, **kwargs)


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


async def test_metrics_have_the_names_the_gateway_reads(engines: EngineSet) -> None:
    metrics = await scrape(engines.urls[0])
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:request_success_total",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in metrics.names(), name
    assert metrics.finished(finished_reason="length") >= 0


async def test_server_info_reports_max_num_seqs(engines: EngineSet) -> None:
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.get(engines.urls[0] + "/server_info", params={"config_format": "json"})
    assert response.status_code == 200
    assert vllm_capacity(response.json()) == engines.max_num_seqs


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_request_id_header_names_the_response(engines: EngineSet, route: str) -> None:
    response = await post(
        engines.urls[0], route, body(engines, route, 4), headers={"X-Request-Id": "e2e-abc"}
    )
    assert response.status_code == 200
    assert response.headers.get("x-request-id") == "e2e-abc"
    prefix = "chatcmpl-" if route == "chat" else "cmpl-"
    assert response.json()["id"] == prefix + "e2e-abc"
    assert response.json()["usage"]["completion_tokens"] == 4


async def test_stream_has_role_chunk_finish_usage_and_done(engines: EngineSet) -> None:
    payload = body(engines, "chat", 6, stream=True, stream_options={"include_usage": True})
    response = await post(engines.urls[0], "chat", payload)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_errors_are_openai_shaped(engines: EngineSet) -> None:
    unknown = await post(engines.urls[0], "chat", {**body(engines, "chat", 4), "model": "no-such-model"})
    assert unknown.status_code == 404
    assert set(unknown.json()["error"]) >= {"message", "type", "code"}
    too_long = await post(engines.urls[0], "chat", body(engines, "chat", engines.max_model_len + 1))
    assert too_long.status_code == 400
    assert "message" in too_long.json()["error"]


async def test_engine_queues_what_exceeds_max_num_seqs(engines: EngineSet) -> None:
    """Without the gateway the engine's own queue fills: what the gateway must prevent. The queue-time
    histogram shows it exactly; the waiting gauge only where a scrape got through while the engine was busy."""
    url, extra = engines.urls[0], 2
    before = await scrape(url)
    async with MetricsMonitor((url,)) as monitor:
        replies = await asyncio.gather(
            *(
                post(url, "completions", body(engines, "completions", 1200))
                for _ in range(engines.max_num_seqs + extra)
            )
        )
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1200 for r in replies)
    after = monitor.samples[-1]
    assert after.queued_over(1.0) - before.queued_over(1.0) == extra
    assert monitor.max("running") <= engines.max_num_seqs
    busy = [m for m in monitor.samples if m.running]
    print(f"{len(busy)} scrapes answered while the engine generated: {busy}")


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_the_generation(engines: EngineSet, stream: bool) -> None:
    url = engines.urls[0]
    before = await scrape(url)
    payload = body(engines, "completions", LONG, stream=stream)
    async with httpx.AsyncClient(timeout=60.0) as client:
        if stream:
            async with client.stream("POST", url + "/v1/completions", json=payload) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # generating: now leave
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.post(url + "/v1/completions", json=payload), 1.5)
    left_at = time.monotonic()
    await wait_for("engine running gauge back to 0", lambda: scrape(url), lambda m: m.running == 0, 10.0)
    settled = await scrape(url)
    await asyncio.sleep(1.0)
    after = await scrape(url)
    assert after.generated == settled.generated, "tokens still generated after the abort"
    assert after.generated - before.generated < LONG, "the generation ran to its end"
    print(f"disconnect -> running 0 within {settled.at - left_at:.2f} s (scrape latency included)")


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamReply:
    status: int
    chunks: tuple[dict[str, Any], ...]

    @property
    def tokens(self) -> int:
        usage = next((c["usage"] for c in reversed(self.chunks) if c.get("usage")), None)
        return int(usage["completion_tokens"]) if usage else -1

    @property
    def finish_reason(self) -> str | None:
        finishes = [c["choices"][0]["finish_reason"] for c in self.chunks if c.get("choices")]
        return next((f for f in reversed(finishes) if f), None)


async def stream_completion(url: str, payload: dict[str, Any], generating: asyncio.Event) -> StreamReply:
    """A streaming completion that sets `generating` at its first token: a client-side sign that the engine
    runs it (the engine's own /metrics can take seconds to answer while it generates)."""
    chunks = []
    async with (
        httpx.AsyncClient(timeout=120.0) as client,
        client.stream(
            "POST",
            url + "/v1/completions",
            json={**payload, "stream": True, "stream_options": {"include_usage": True}},
        ) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[len("data: ") :]))
                generating.set()
    return StreamReply(status=response.status_code, chunks=tuple(chunks))


async def inflight(engines: EngineSet, url: str, n: int, max_tokens: int) -> list[asyncio.Task[StreamReply]]:
    """`n` streaming requests, returned once every one of them has produced a token."""
    events = [asyncio.Event() for _ in range(n)]
    payload = body(engines, "completions", max_tokens)
    tasks = [asyncio.create_task(stream_completion(url, payload, e)) for e in events]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30.0)
    assert not any(t.done() for t in tasks), "a request finished before all had started: make it longer"
    return tasks


async def test_pause_keep_freezes_in_flight_work_until_resume(engines: EngineSet) -> None:
    url = engines.urls[0]
    tasks = await inflight(engines, url, 2, MEDIUM)
    async with httpx.AsyncClient(timeout=60.0) as client:
        assert (await client.post(url + "/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await client.get(url + "/is_paused")).json() == {"is_paused": True}
        first = await scrape(url)
        await asyncio.sleep(1.0)
        second = await scrape(url)
        assert second.generated == first.generated, "generation went on while paused"
        assert second.running == 2, "paused requests left the running set"
        assert not any(t.done() for t in tasks)
        assert (await client.post(url + "/resume")).json() == {"status": "resumed"}
    for reply in await asyncio.gather(*tasks):
        assert (reply.status, reply.tokens, reply.finish_reason) == (200, MEDIUM, "length")


async def test_pause_abort_ends_in_flight_work_with_finish_reason_abort(engines: EngineSet) -> None:
    url = engines.urls[0]
    tasks = await inflight(engines, url, engines.max_num_seqs, LONG)
    async with httpx.AsyncClient(timeout=60.0) as client:
        assert (await client.post(url + "/pause", params={"mode": "abort"})).status_code == 200
        replies = await asyncio.wait_for(asyncio.gather(*tasks), 20.0)
        await client.post(url + "/resume")
    for reply in replies:
        assert reply.status == 200  # not an HTTP error: a short answer that says "abort"
        assert reply.finish_reason == "abort"
        assert 0 < reply.tokens < LONG


async def test_pause_wait_returns_once_in_flight_work_is_done(engines: EngineSet) -> None:
    """The pause answers when the engine has finished its work; the HTTP answers may still be on their way
    (the API server lags the engine core on this CPU), and they end without a resume."""
    url = engines.urls[0]
    before = await scrape(url)
    tasks = await inflight(engines, url, 2, MEDIUM)
    async with httpx.AsyncClient(timeout=120.0) as client:
        assert (await client.post(url + "/pause", params={"mode": "wait"})).status_code == 200
        paused = await scrape(url)
        assert paused.running == 0
        assert paused.generated - before.generated == 2 * MEDIUM
        try:
            replies = await asyncio.wait_for(asyncio.gather(*tasks), 30.0)
        finally:
            await client.post(url + "/resume")
    assert all((r.tokens, r.finish_reason) == (MEDIUM, "length") for r in replies)


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_requests_sent_while_paused_wait_for_resume(engines: EngineSet, mode: str) -> None:
    """vLLM 0.32.0 holds new requests during a pause in every mode (0.33's docs say 503 in abort/wait)."""
    url = engines.urls[0]
    async with httpx.AsyncClient(timeout=60.0) as client:
        assert (await client.post(url + "/pause", params={"mode": mode})).status_code == 200
        try:
            late = asyncio.create_task(post(url, "completions", body(engines, "completions", 8)))
            await asyncio.sleep(1.5)
            assert not late.done(), f"answered while paused: {late.result().status_code}"
        finally:
            await client.post(url + "/resume")
    response = await asyncio.wait_for(late, 30.0)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8


async def test_weight_version_update(engines: EngineSet) -> None:
    url = engines.urls[0]
    async with httpx.AsyncClient(timeout=30.0) as client:
        response = await client.post(url + "/update_weight_version", json={"new_version": "e2e-v7"})
        assert response.status_code == 200
        assert (await client.get(url + "/weight_info")).json()["weight_version"] == "e2e-v7"


TOKEN_IDS = [10, 20, 30, 40, 50]  # inside the tiny model's vocabulary (2,048 ids)


async def test_tokens_route_answers_ids_and_logprobs_whole_and_streamed(engines: EngineSet) -> None:
    """vLLM's token-in/token-out `/inference/v1/generate` (served with `--enable-scale-out`; SkyRL's and
    prime-rl's rollouts): the request named `generate-tokens-<X-Request-Id>`, ids and their logprobs in the
    choice, the stream's chunks carrying the new ids and ending with the usage frame and `[DONE]`."""
    url = engines.urls[0] + "/inference/v1/generate"
    params = {"max_tokens": 6, "ignore_eos": True, "logprobs": 0, "temperature": 0.0}
    payload = {"model": engines.model, "token_ids": TOKEN_IDS, "sampling_params": params}
    async with httpx.AsyncClient(timeout=120.0) as client:
        whole = await client.post(url, json=payload, headers={"X-Request-Id": "e2e-tokens"})
        streamed = await client.post(
            url, json={**payload, "stream": True, "stream_options": {"include_usage": True}}
        )
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["request_id"] == "generate-tokens-e2e-tokens" and answer["output_mode"] == "tokens"
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 6
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    assert answer["usage"]["completion_tokens"] == 6 and answer["usage"]["prompt_tokens"] == len(TOKEN_IDS)
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    ids = [i for chunk in chunks[:-1] for i in chunk["choices"][0]["token_ids"]]
    assert len(ids) == 6 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    print(f"greedy ids whole {choice['token_ids']}, streamed {ids}")
