"""Engine faults the gateway must survive: crashes mid-generation, connection resets, garbage answers, engines
unreachable at start-up. Every fault ends with the gateway still serving.

What a client gets, by what it had already received when the engine failed:
- nothing yet (any non-streaming client; a streaming client before its first event): a transparent retry on
  another engine, then an ordinary answer;
- part of a stream: the rest of it, continued on another engine (server/continuation.py), or, where the
  request cannot be continued, an SSE `data: {"error": ...}` event: never a stream that silently stops short.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.config import EngineSpec
from rolloutsim import SimCluster
from rolloutsim.faults import Fault
from tests.ports import port_of, reserved_port
from tests.reliability.chaos import ChaosEngine
from tests.reliability.conftest import bump_figure, wait_for
from tests.server.conftest import MakeCluster, MakeGateway

pytestmark = pytest.mark.reliability

SCALE = 10.0  # the default profile decodes ~90 tok/s: 400 tokens take ~0.45 s real at this scale
MAX_TOKENS = 400


def chat(max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


@dataclass
class StreamResult:
    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [e for e in self.events if "error" in e]

    @property
    def pieces(self) -> list[str]:
        """The content of each event that carries some (the simulator streams one token per event)."""
        parts = []
        for event in self.events:
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece:
                    parts.append(piece)
        return parts

    @property
    def content(self) -> str:
        return "".join(self.pieces)


async def stream(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> StreamResult:
    async with http.stream("POST", url + path, json={**body, "stream": True}) as response:
        result = StreamResult(status=response.status_code)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result.done = True
            else:
                result.events.append(orjson.loads(line[6:]))
        return result


def assert_complete_chat(response: httpx.Response, max_tokens: int = MAX_TOKENS) -> None:
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == max_tokens


def assert_whole_or_error(result: StreamResult, max_tokens: int) -> str:
    """A stream either ran to its end (max_tokens tokens, none twice, no error) or carries an error event."""
    assert result.status == 200
    assert result.done, "a stream must end with [DONE], never just stop"
    if result.errors:
        error = result.errors[0]["error"]
        assert error["message"] and error["type"]
        return "error_event"
    assert len(result.pieces) == max_tokens
    return "whole"


async def wait_running(cluster: SimCluster, index: int, count: int = 1) -> None:
    await wait_for(
        lambda: cluster.engines[index].running_count >= count, what=f"engine {index} running {count}"
    )


# --- crashes ---------------------------------------------------------------------------------------------------


async def test_engine_crash_mid_generation_non_streaming_clients_get_whole_answers_elsewhere(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, keepalive_interval=0)
    requests = [
        asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=chat())) for _ in range(8)
    ]
    await wait_running(cluster, 0, 2)
    cluster.engines[0].set_fault(Fault(kind="crash"))
    for response in await asyncio.gather(*requests):
        assert_complete_chat(response)
        assert response.headers["X-Rolloutgate-Engine"] == cluster.urls[1]
    bump_figure("faults_survived.engine_crash_non_streaming", len(requests))
    cluster.engines[0].clear_faults()
    after = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(8))
    assert_complete_chat(after, 8)


async def test_engine_crash_mid_stream_continues_or_sends_an_error_event(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, keepalive_interval=0)
    streams = [asyncio.create_task(stream(http, gateway.url, chat())) for _ in range(6)]
    await wait_for(
        lambda: cluster.engines[0].generated_tokens_total >= 20, what="tokens streamed from engine 0"
    )
    cluster.engines[0].set_fault(Fault(kind="crash"))
    outcomes = [assert_whole_or_error(result, MAX_TOKENS) for result in await asyncio.gather(*streams)]
    assert len(outcomes) == 6
    bump_figure("faults_survived.engine_crash_mid_stream", len(outcomes))
    after = await stream(http, gateway.url, chat(8))
    assert after.done and not after.errors


async def test_a_stream_that_cannot_be_continued_ends_with_an_error_event(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """A completions prompt given as token ids cannot be continued elsewhere: the client gets an SSE error
    event (the OpenAI SDK raises APIError on it, LiteLLM MidStreamFallbackError), then [DONE]."""
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, keepalive_interval=0)
    body = {"model": "sim-model", "prompt": [11, 12, 13, 14], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    task = asyncio.create_task(stream(http, gateway.url, body, path="/v1/completions"))
    await wait_for(
        lambda: any(e.generated_tokens_total >= 10 for e in cluster.engines), what="tokens streamed"
    )
    busy = next(e for e in cluster.engines if e.running_count)
    busy.set_fault(Fault(kind="crash"))
    result = await task
    assert result.status == 200 and result.done
    assert result.content, "the client had received part of the stream"
    assert len(result.errors) == 1, result.events[-3:]
    assert result.errors[0]["error"]["type"] == "upstream_error"
    bump_figure("faults_survived.engine_crash_uncontinuable_stream", 1)


# --- resets and garbage (a misbehaving engine in front of a simulated one) -----------------------------------

NOTHING_SENT = ("reset", "garbage_sse", "garbage_body", "garbage_http", "bad_status")
PART_SENT = ("reset_after", "truncate")


@pytest.mark.parametrize("streams", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("mode", NOTHING_SENT + PART_SENT)
async def test_resets_and_garbage_from_an_engine(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, mode: str, streams: bool
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    async with ChaosEngine(cluster.urls[0], mode=mode, after_events=4) as chaos:
        gateway = await make_gateway(
            cluster,
            engines=[
                EngineSpec(url=chaos.url, family="sglang"),
                EngineSpec(url=cluster.urls[1], family="sglang"),
            ],
            keepalive_interval=0,
        )
        body = chat(60)
        if streams:
            results = await asyncio.gather(*(stream(http, gateway.url, body) for _ in range(6)))
            outcomes = [assert_whole_or_error(r, 60) for r in results]
            if mode in NOTHING_SENT:  # the client had seen nothing: a transparent retry
                assert outcomes == ["whole"] * 6, [r.errors for r in results]
        else:
            responses = await asyncio.gather(
                *(http.post(f"{gateway.url}/v1/chat/completions", json=body) for _ in range(6))
            )
            for response in responses:
                assert_complete_chat(response, 60)
                assert response.headers["X-Rolloutgate-Engine"] == cluster.urls[1]
        assert chaos.generations[mode] >= 1, "the fault was never hit"
        bump_figure(f"faults_survived.engine_{mode}", 6)
        chaos.mode = "pass"
        health = await http.get(f"{gateway.url}/health")
        assert health.status_code == 200


async def test_when_every_engine_answers_garbage_the_client_gets_a_clear_502_and_the_gateway_recovers(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    async with ChaosEngine(cluster.urls[0], mode="garbage_body") as chaos:
        gateway = await make_gateway(
            cluster, engines=[EngineSpec(url=chaos.url, family="sglang")], keepalive_interval=0
        )
        response = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(20))
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["type"] == "upstream_error" and error["message"]
        chaos.mode = "pass"
        recovered = None
        for _ in range(100):  # the engine may sit out a quarantine first
            recovered = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(20))
            if recovered.status_code == 200:
                break
            assert recovered.status_code in (502, 503), recovered.text
            await asyncio.sleep(0.1)
        assert recovered is not None
        assert_complete_chat(recovered, 20)
        bump_figure("faults_survived.all_engines_garbage", 1)


# --- engines unreachable at start-up ----------------------------------------------------------------------------


async def test_refused_and_unresolvable_engines_do_not_hold_start_up_and_join_when_they_appear(
    make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    with reserved_port() as reservation:  # bound, not listening: connections to it are refused
        port = port_of(reservation)
        refused = f"http://127.0.0.1:{port}"
        unresolvable = "http://rolloutgate-no-such-host.invalid:8000"
        started = time.monotonic()
        gateway = await make_gateway(
            engines=[EngineSpec(url=refused, family="sglang"), EngineSpec(url=unresolvable, family="sglang")],
            time_scale=SCALE,
            no_engine_grace=10.0,  # 1 s real: queued requests fail fast while no engine is reachable
            health_interval=2.0,  # 0.2 s real between join attempts
        )
        assert time.monotonic() - started < 10, "start-up waited for unreachable engines"
        assert (await http.get(f"{gateway.url}/ready")).status_code == 503
        early = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(8))
        assert early.status_code == 503, early.text
        assert early.headers.get("Retry-After")

        reservation.close()  # handed to the engine that comes up late, the moment before it binds
        async with SimCluster(engines=1, time_scale=SCALE, base_port=port) as cluster:
            await wait_for(lambda: len(gateway.context.pool.engines) == 1, what="the late engine joined")
            ready = await http.get(f"{gateway.url}/ready")
            assert ready.status_code == 200
            response = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(8))
            assert_complete_chat(response, 8)
            assert response.headers["X-Rolloutgate-Engine"] == cluster.urls[0]
        bump_figure("faults_survived.engine_refused_at_start", 1)
        bump_figure("faults_survived.engine_dns_failure_at_start", 1)
