"""Through the gateway: vLLM's token-in/token-out `/inference/v1/generate` (SkyRL's and prime-rl's rollouts,
docs/frameworks/skyrl.md), an inference route like chat and completions: queued, placed by session, charged
engine time, bad ids refused before an engine sees them."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, scrape_all

pytestmark = [pytest.mark.e2e, pytest.mark.api("vllm")]

ROUTE = "/inference/v1/generate"
TOKEN_IDS = [10, 20, 30, 40, 50]  # inside the tiny model's vocabulary (2,048 ids)


def tokens_body(engines: EngineSet, max_tokens: int, **extra: Any) -> dict[str, Any]:
    params = {"max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}
    return {"model": engines.model, "token_ids": TOKEN_IDS, "sampling_params": params, **extra}


async def test_tokens_whole_and_streamed_through_the_gateway_each_session_on_one_engine(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    gateway = gateways()
    before = await scrape_all(engines.urls)
    served: dict[str, set[str]] = {"0_0": set(), "1_0": set()}
    async with httpx.AsyncClient(timeout=120.0) as client:
        for _ in range(3):
            for session in served:
                response = await client.post(
                    gateway.url + ROUTE, json=tokens_body(engines, 5), headers={"X-Session-ID": session}
                )
                assert response.status_code == 200, response.text
                assert "charged=" in response.headers["X-Rolloutgate-Timing"]
                served[session].add(response.headers["X-Rolloutgate-Engine"])
                [choice] = response.json()["choices"]
                assert len(choice["token_ids"]) == 5 == len(choice["logprobs"]["content"])
        streamed = await client.post(gateway.url + ROUTE, json=tokens_body(engines, 7, stream=True))
    assert all(len(engines_used) == 1 for engines_used in served.values()), served
    assert streamed.status_code == 200
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)  # the usage frame the gateway asked for is its own
    assert sum(len(chunk["choices"][0]["token_ids"]) for chunk in chunks) == 7
    after = await scrape_all(engines.urls)
    made = sum(after[u].generated - before[u].generated for u in engines.urls)
    assert made == 2 * 3 * 5 + 7  # the engines' own counters: each call ran once


async def test_an_out_of_vocabulary_id_is_refused_by_the_gateway_and_the_engines_serve_on(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    gateway = gateways()
    async with httpx.AsyncClient(timeout=60.0) as client:
        body = tokens_body(engines, 4)
        body["token_ids"] = [*TOKEN_IDS, 999_999_999]
        refused = await client.post(gateway.url + ROUTE, json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "token_id_out_of_vocabulary"
        assert f"token_ids[{len(TOKEN_IDS)}]" in error["message"]
        served = await client.post(gateway.url + ROUTE, json=tokens_body(engines, 4))
    assert served.status_code == 200, served.text
    assert len(served.json()["choices"][0]["token_ids"]) == 4
