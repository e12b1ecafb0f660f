"""Through the gateway: chat and completions, streaming and not, with the OpenAI SDK and LiteLLM."""

from __future__ import annotations

import httpx
import pytest
from tests.e2e.calls import litellm_call, openai_call, openai_client
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape_all

pytestmark = pytest.mark.e2e


async def test_models_and_health(engines: EngineSet, gateways: MakeGateway) -> None:
    gateway = gateways()
    async with httpx.AsyncClient(timeout=30.0) as client:
        models = (await client.get(gateway.v1 + "/models")).json()
        workers = (await client.get(gateway.url + "/workers")).json()
    assert engines.model in [m["id"] for m in models["data"]]
    assert sorted(w["url"] for w in workers["workers"]) == sorted(engines.urls)
    assert all(w["capacity"] == engines.max_num_seqs for w in workers["workers"]), (
        "capacity not read from engine"
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_openai_sdk(engines: EngineSet, gateways: MakeGateway, route: str, stream: bool) -> None:
    gateway = gateways()
    before = await scrape_all(engines.urls)
    client = openai_client(gateway)
    answer = await openai_call(client, engines, route=route, stream=stream, max_tokens=24)
    await client.close()
    assert answer.tokens == 24
    assert answer.finish_reason == "length"
    assert answer.text
    assert answer.engine in engines.urls
    assert answer.timing()["attempts"] == 1
    after = await scrape_all(engines.urls)
    served = after[answer.engine].generated - before[answer.engine].generated
    assert served == 24, "the engine the gateway names did not generate the answer"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_litellm(engines: EngineSet, gateways: MakeGateway, route: str, stream: bool) -> None:
    answer = await litellm_call(gateways(), engines, route=route, stream=stream, max_tokens=24)
    assert answer.tokens == 24
    assert answer.finish_reason == "length"
    assert answer.text
