"""A weight update cycle through the gate gives no client error: requests in flight and requests arriving
during the update all get their whole answer, in every pause mode. The engines themselves confirm the pause
(their pause flag where they state one, a frozen token counter) and the update (the weight version they
state): vLLM `/is_paused` and `/weight_info`, SGLang `/ready` (0.5.23; 0.5.9 has none) and `/model_info`."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
from tests.e2e.calls import Answer, openai_call, openai_client, started_streams
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, engine_is_paused, engine_weight_version, scrape_all, settled
from tests.server.users_path import metric_sum

pytestmark = pytest.mark.e2e

TOKENS = 600  # a few seconds per request on the tiny CPU model


async def requests(engines: EngineSet, client: Any, count: int) -> list[asyncio.Task[Answer]]:
    return [
        asyncio.create_task(openai_call(client, engines, stream=i % 2 == 0, max_tokens=TOKENS))
        for i in range(count)
    ]


def assert_whole(answers: list[Answer]) -> None:
    for answer in answers:
        assert (answer.tokens, answer.finish_reason) == (TOKENS, "length"), answer


@pytest.mark.parametrize("mode", ["drain", "abort", "in_place"])
async def test_weight_update_cycle_gives_no_client_error(
    engines: EngineSet, gateways: MakeGateway, mode: str
) -> None:
    gateway = gateways()
    client = openai_client(gateway)
    version = f"e2e-{mode}-{uuid.uuid4().hex[:8]}"
    body: dict[str, Any] = {"new_version": version}
    if engines.api == "sglang":
        # SGLang's /update_weight_version aborts every request first unless told not to (0.5.9 and 0.5.23:
        # `abort_all_requests` defaults to true); a trainer that keeps its in-flight work says so
        body["abort_all_requests"] = False
    # In flight for sure: streams that have delivered tokens, and whole-answer requests sent with them.
    whole = [
        asyncio.create_task(openai_call(client, engines, max_tokens=TOKENS)) for _ in range(len(engines.urls))
    ]
    streams = await started_streams(gateway.url, engines, len(engines.urls), max_tokens=TOKENS)
    async with httpx.AsyncClient(timeout=300.0) as admin:
        update = asyncio.create_task(
            admin.post(
                gateway.url + "/admin/update_weights",
                json={"path": "/update_weight_version", "body": body, "mode": mode},
            )
        )
        await asyncio.sleep(0.2)
        arriving = await requests(engines, client, len(engines.urls) * 2)
        report = await update
        assert report.status_code == 200, report.text
        assert report.json()["ok"] is True
        for url in engines.urls:
            assert await engine_weight_version(admin, engines, url) == version
    assert_whole(await asyncio.gather(*whole, *arriving))
    await asyncio.gather(*streams)  # an error event or a cut stream raises here
    await client.close()


@pytest.mark.parametrize("mode", ["abort", "in_place"])
async def test_gate_pause_pauses_the_engines_and_loses_nothing(
    engines: EngineSet, gateways: MakeGateway, mode: str
) -> None:
    gateway = gateways()
    holders = await started_streams(gateway.url, engines, len(engines.urls), max_tokens=TOKENS)
    client = openai_client(gateway)
    async with httpx.AsyncClient(timeout=60.0) as admin:
        paused = await admin.post(gateway.url + "/admin/pause", json={"mode": mode})
        assert paused.status_code == 200, paused.text
        try:
            arriving = await requests(engines, client, 2)
            for url in engines.urls:
                # SGLang 0.5.9 states no pause flag (None): the frozen token counter below shows the pause
                flag = None if engines.version == "0.5.9" else True
                assert await engine_is_paused(admin, engines, url) is flag
            first = await settled(engines.urls)  # the decode step in flight at the pause lands first
            await asyncio.sleep(1.5)
            second = await scrape_all(engines.urls)
            for url in engines.urls:
                assert second[url].progress == first[url].progress, f"{url} generated while paused"
                assert second[url].waiting == 0, f"{url} was sent work while the gate was closed"
            assert not any(t.done() for t in arriving)
        finally:
            resumed = await admin.post(gateway.url + "/admin/resume")
        assert resumed.status_code == 200, resumed.text
    assert_whole(await asyncio.gather(*arriving))
    await asyncio.gather(*holders)  # the held streams end normally too (an error event raises here)
    await client.close()


# twice the stall timeout below: without the engine's own signal this is a hang. 4 s, not 3: with two CPU hogs
# beside the two CPU engines on this 2-core machine, a stream went 3 s without a token while its engine served
# others (judged stuck alone, twice); at 4 s it passed under the same load
STALL_S = 4.0
PAUSE_S = 2 * STALL_S


@pytest.mark.api("vllm")  # SGLang's direct pauses: test_gateway_sglang.py
async def test_an_engine_paused_directly_is_not_charged_or_quarantined(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    """A trainer pauses the real vLLM engines itself (`/pause?mode=keep`) and never tells the gateway: the gateway
    reads `/is_paused`, charges nobody for the pause, quarantines no engine, and every call completes."""
    gateway = gateways(stall_timeout=STALL_S, health_interval=1)
    client = openai_client(gateway)
    holders = await started_streams(gateway.url, engines, len(engines.urls), max_tokens=TOKENS)
    whole = await requests(engines, client, len(engines.urls))
    async with httpx.AsyncClient(timeout=60.0) as trainer:
        for url in engines.urls:
            assert (await trainer.post(url + "/pause", params={"mode": "keep"})).json() == {
                "status": "paused"
            }
        try:
            await asyncio.sleep(PAUSE_S)
            state = (await trainer.get(gateway.url + "/admin/state")).json()
            assert all(e["paused_by_engine"] for e in state["engines"]), state["engines"]
        finally:
            for url in engines.urls:
                await trainer.post(url + "/resume")
        answers = await asyncio.gather(*whole)
        await asyncio.gather(*holders)  # the held streams end normally (an error event raises here)
        metrics = (await trainer.get(gateway.url + "/metrics")).text
    assert_whole(answers)
    timings = [a.timing() for a in answers]
    assert max(t["paused"] for t in timings) >= PAUSE_S - 2, timings  # recognised within a health interval
    assert all(t["charged"] <= t["wall"] - t["paused"] + 0.5 for t in timings), timings
    assert "# TYPE rolloutgate_engine_quarantines_total counter" in metrics
    assert metric_sum(metrics, "rolloutgate_engine_quarantines_total") == 0
    await client.close()
