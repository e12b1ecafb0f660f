"""Each adapter against the real simulator (rolloutsim), both API flavours, over loopback HTTP.

The simulator renders its own non-streaming answers; the assembler must rebuild them from the streams the
adapters read, field for field (only `id` and `created` differ between two requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from rolloutgate.engines.base import (
    EngineClient,
    EngineFamily,
    Route,
    UpstreamCall,
    UpstreamError,
    UpstreamEvent,
)
from rolloutgate.engines.detect import detect_family, make_client
from rolloutgate.server.assemble import assemble
from rolloutsim import SimCluster
from tests.engines.started import collect as collect_events
from tests.engines.started import stream
from tests.sim.helpers import wait_until

MODEL = "sim-model"
TIME_SCALE = 20.0
# meta_info fields that depend on when a request ran, not on what it generated
_TIMING = {"e2e_latency", "response_sent_to_client_ts", "id"}


def simulator(api: str) -> SimCluster:
    return SimCluster(engines=1, api=api, profile="default", time_scale=TIME_SCALE)


async def client_of(cluster: SimCluster, session: aiohttp.ClientSession) -> EngineClient:
    family = await detect_family(session, cluster.urls[0])
    assert family is {"sglang": EngineFamily.SGLANG, "vllm": EngineFamily.VLLM}[cluster.api]
    return make_client(family, cluster.urls[0], session)


@pytest.fixture(params=["sglang", "vllm"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[SimCluster]:
    async with simulator(request.param) as sim:
        yield sim


@pytest.fixture
async def client(cluster: SimCluster, session: aiohttp.ClientSession) -> EngineClient:
    return await client_of(cluster, session)


def bodies(route: Route, max_tokens: int) -> dict[str, Any]:
    if route is Route.CHAT:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens,
        }
    if route is Route.COMPLETIONS:
        return {"model": MODEL, "prompt": "once upon a time", "max_tokens": max_tokens}
    return {"text": "once upon a time", "sampling_params": {"max_new_tokens": max_tokens}}


def streamed(route: Route, max_tokens: int) -> dict[str, Any]:
    """The body of a client that streams: the engine streams it to the gateway too."""
    return {**bodies(route, max_tokens), "stream": True}


async def collect(client: EngineClient, call: UpstreamCall) -> list[UpstreamEvent]:
    return await collect_events(client, call)


async def direct(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return orjson.loads(await resp.read())


def comparable(answer: Any, *, api: str) -> Any:
    """An answer without the fields that differ between two runs of the same request.

    vLLM answers are compared by content (null and empty fields dropped): the simulator renders an older
    vLLM's field set (`tool_calls: []`, `reasoning_content`, completions' `prompt_token_ids` at the top)
    than reference/engines.md gives for 0.33, which the assembler follows. SGLang answers compare exactly.
    """
    if isinstance(answer, list):
        return [comparable(item, api=api) for item in answer]
    out = {k: v for k, v in answer.items() if k not in ("id", "created")}
    if isinstance(out.get("meta_info"), dict):
        out["meta_info"] = {k: v for k, v in out["meta_info"].items() if k not in _TIMING}
    return _without_empty(out) if api == "vllm" else out


def _without_empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_empty(v) for k, v in value.items() if v is not None and v != []}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


async def test_probe_health_and_load(cluster: SimCluster, client: EngineClient) -> None:
    info = await client.probe()
    assert info.capacity == cluster.config.max_running_requests
    assert info.models == (MODEL,)
    assert info.max_model_len == cluster.config.context_len
    assert await client.health()
    load = await client.load()
    assert (load.running, load.waiting) == (0, 0)


@pytest.mark.parametrize("route", [Route.CHAT, Route.COMPLETIONS, Route.GENERATE])
async def test_assembled_answer_equals_the_engines_own(
    cluster: SimCluster, client: EngineClient, session: aiohttp.ClientSession, route: Route
) -> None:
    if route is Route.GENERATE and cluster.api == "vllm":
        with pytest.raises(UpstreamError) as refused:
            await collect(client, UpstreamCall(request_id="g", route=route, body=bodies(route, 4)))
        assert refused.value.status == 400 and not refused.value.retryable
        return
    await client.probe()  # SGLang: learn the weight version its answers carry
    body = bodies(route, 24)
    call = UpstreamCall(request_id=f"stream-{route.name}", route=route, body=body)
    events = await collect(client, call)
    expected = await direct(session, cluster.urls[0] + route.value, body)
    assert comparable(orjson.loads(assemble(route, events)), api=cluster.api) == comparable(
        expected, api=cluster.api
    )
    usage = (
        expected["usage"]["completion_tokens"]
        if route is not Route.GENERATE
        else expected["meta_info"]["completion_tokens"]
    )
    assert sum(e.tokens for e in events) == usage == 24
    assert [e.finish_reason for e in events if e.finish_reason] == ["length"]
    if route is Route.GENERATE:
        # a non-streaming client's /generate: the first token at once, then the end (FIRST_AND_LAST)
        assert [e.tokens for e in events] == [1, 23]
    else:  # OpenAI routes come back whole: the engine's output work is the direct call's
        assert [e.is_whole_body for e in events] == [True]


async def test_streaming_client_sees_only_what_it_asked_for(
    cluster: SimCluster, client: EngineClient
) -> None:
    body = {**bodies(Route.CHAT, 5), "stream": True}
    events = await collect(client, UpstreamCall(request_id="plain-stream", route=Route.CHAT, body=body))
    forwarded = [e for e in events if not e.is_gateway_only]
    assert len(forwarded) == len(events) - 1  # the usage frame is the gateway's
    assert b'"choices":[]' in events[-1].data and events[-1].is_gateway_only


async def test_abort_stops_the_generation(cluster: SimCluster, client: EngineClient) -> None:
    route = Route.CHAT
    call = UpstreamCall(request_id="to-abort", route=route, body=streamed(route, 5000))
    events: list[UpstreamEvent] = []
    events_of = stream(client, call)
    async with events_of:
        async for event in events_of:
            events.append(event)
            if len(events) == 3:
                await client.abort("to-abort")
            if event.finish_reason is not None:
                break
    assert events[-1].finish_reason == "abort"
    assert sum(e.tokens for e in events) < 5000
    await wait_until(lambda: cluster.engines[0].running_count == 0, "the engine freed")


# On a fake-time loop (looptime) the simulator's seconds pass when the loop is idle: a pause is checked long
# after the generation would have ended, at no real cost. The simulator is started in the test, not in a
# fixture: its clock is the loop's, and looptime fakes the loop's time inside the test only.
PAUSED_S = 10.0  # of the loop's time: 200 simulated seconds, some 40 times what the whole generation takes


@pytest.mark.looptime
@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_pause_in_place_and_resume(api: str, session: aiohttp.ClientSession) -> None:
    loop = asyncio.get_running_loop()
    async with simulator(api) as cluster:
        client = await client_of(cluster, session)
        engine = cluster.engines[0]
        route = Route.COMPLETIONS
        call = UpstreamCall(request_id="paused", route=route, body=streamed(route, 400))
        events_of = stream(client, call)
        events = [await anext(events_of)]
        await client.pause("in_place")
        assert engine.paused
        before = engine.generated_tokens_total
        await asyncio.sleep(PAUSED_S)
        assert engine.generated_tokens_total == before
        await client.resume()
        assert not engine.paused
        resumed = loop.time()
        events += [event async for event in events_of]
        assert loop.time() - resumed < PAUSED_S / 10  # running, the rest took a fraction of the pause
        assert sum(e.tokens for e in events) == 400
        assert events[-2].finish_reason == "length"


async def test_pause_abort_ends_in_flight_requests(cluster: SimCluster, client: EngineClient) -> None:
    route = Route.CHAT
    call = UpstreamCall(request_id="pause-abort", route=route, body=streamed(route, 5000))
    events_of = stream(client, call)
    first = await anext(events_of)
    pausing = asyncio.create_task(client.pause("abort"))
    events = [first, *[event async for event in events_of]]
    await pausing
    assert [e.finish_reason for e in events if e.finish_reason] == ["abort"]
    await client.resume()
    assert not cluster.engines[0].paused


async def test_load_sees_a_running_request(cluster: SimCluster, client: EngineClient) -> None:
    route = Route.CHAT
    call = UpstreamCall(request_id="loaded", route=route, body=streamed(route, 2000))
    events_of = stream(client, call)
    async with events_of:
        await anext(events_of)
        load = await client.load()
        assert load.running == 1
    await client.abort("loaded")
    # closing (and abort) freed the engine
    await wait_until(lambda: cluster.engines[0].running_count == 0, "the engine freed")


async def test_generates_is_a_token_a_wedged_engine_cannot_give(
    cluster: SimCluster, client: EngineClient
) -> None:
    """The check a quarantined engine passes to come back (server/pool.py): `/health` says 200 from a wedged
    engine (vLLM#46811); a one-token generation does not come."""
    assert await client.generates(MODEL)
    cluster.engines[0].set_fault("wedge")
    assert await client.health()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(10.0 / TIME_SCALE):  # a token takes ~0.02 simulated s; wedged, never
            await client.generates(MODEL)
    cluster.engines[0].clear_faults("wedge")
    assert await client.generates(None)  # the family's default model
