"""vLLM's token-in/token-out route, `/inference/v1/generate` (server/front.py), through the gateway: what SkyRL's
and prime-rl's rollouts post (docs/frameworks/skyrl.md). It is an inference route like the others: queued,
placed, charged engine time, its bad input refused before any engine sees it, continued from its last token
when its engine dies."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest

from rolloutsim.ledger import GenerationLedger
from tests.reliability.conftest import wait_for
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.test_continuation import killed_at

ROUTE = "/inference/v1/generate"
PROMPT = list(range(11, 41))


def tokens_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    params = {"max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}
    return {"model": "sim-model", "token_ids": PROMPT, "sampling_params": params, **extra}


def sse_payloads(text: str) -> list[Any]:
    return [
        line[6:] if line == "data: [DONE]" else orjson.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


async def test_a_tokens_call_is_answered_whole_or_streamed_as_vllm_answers_it(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(api="vllm", engines=2)
    gateway = await make_gateway(cluster)
    response = await http.post(gateway.url + ROUTE, json=tokens_body(9))
    assert response.status_code == 200, response.text
    assert response.headers["X-Rolloutgate-Engine"] in cluster.urls
    assert "charged=" in response.headers["X-Rolloutgate-Timing"]
    whole = response.json()
    assert whole["request_id"].startswith("generate-tokens-") and whole["output_mode"] == "tokens"
    [choice] = whole["choices"]
    assert len(choice["token_ids"]) == 9 and choice["finish_reason"] == "length"
    assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    assert whole["usage"]["prompt_tokens"] == len(PROMPT)

    asked_usage = tokens_body(6, stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    events = sse_payloads((await http.post(gateway.url + ROUTE, json=asked_usage)).text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 6
    assert events[0]["prompt_token_ids"] == PROMPT
    assert sum(len(event["choices"][0]["token_ids"]) for event in events[:-2]) == 6

    # the gateway asks every stream for its usage frame; a client that did not ask is not sent it
    events = sse_payloads((await http.post(gateway.url + ROUTE, json=tokens_body(4, stream=True))).text)
    assert events[-1] == "[DONE]" and all(event["choices"] for event in events[:-1])
    assert sum(len(event["choices"][0]["token_ids"]) for event in events[:-1]) == 4


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"token_ids": [1, 2, 1 << 40], "sampling_params": {}}, "token_ids", "token_id_out_of_vocabulary"),
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids", "invalid_token_id"),
        ({"token_ids": [1, True], "sampling_params": {}}, "token_ids", "invalid_token_id"),
        ({"token_ids": [], "sampling_params": {}}, "token_ids", "invalid_type"),
        ({"token_ids": [[1, 2], [3]], "sampling_params": {}}, "token_ids", "invalid_type"),
        ({"token_ids": [1, 2]}, "sampling_params", "invalid_type"),
        (
            {"token_ids": [1], "sampling_params": {"max_tokens": -1}},
            "sampling_params.max_tokens",
            "invalid_value",
        ),
        ({"token_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n", "invalid_value"),
    ],
)
async def test_a_bad_tokens_body_is_refused_before_any_engine_sees_it(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    body: dict[str, Any],
    param: str,
    code: str,
) -> None:
    cluster = await make_cluster(api="vllm", engines=1)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(cluster)
    response = await http.post(gateway.url + ROUTE, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert ledgers[0].records == []  # nothing reached the engine
    good = await http.post(gateway.url + ROUTE, json=tokens_body(3))
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 3


async def test_an_out_of_vocabulary_id_is_named_in_the_error(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(api="vllm", engines=1)
    gateway = await make_gateway(cluster)
    vocab = cluster.engines[0].config.vocab_size
    response = await http.post(gateway.url + ROUTE, json={"token_ids": [1, vocab], "sampling_params": {}})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        f"'token_ids[1]' is {vocab}, outside the engines' vocabulary [0, {vocab})"
    )


async def test_sglang_engines_answer_the_vllm_route_with_a_400_that_names_it(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(api="sglang", engines=1)
    gateway = await make_gateway(cluster)
    response = await http.post(gateway.url + ROUTE, json=tokens_body(3))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "SGLang has no /inference/v1/generate route; use /v1/completions or /v1/chat/completions"
    )


async def test_a_session_token_budget_caps_the_routes_max_tokens(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(api="vllm", engines=1)
    gateway = await make_gateway(cluster)
    headers = {"X-Rolloutgate-Max-Seq-Len": str(len(PROMPT) + 5)}
    response = await http.post(gateway.url + ROUTE, json=tokens_body(50), headers=headers)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["token_ids"]) == 5


LENGTH = 3_000
KILL_AT = 1_500


async def test_a_streamed_tokens_call_goes_on_from_its_last_token_when_its_engine_dies(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """The client's one stream holds LENGTH ids; the engine left was given the prompt plus every id the client
    had been sent, and made only the rest (the engines' own ledgers say so)."""
    cluster = await make_cluster(api="vllm", engines=2, time_scale=25.0)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    gateway = await make_gateway(cluster, keepalive_interval=0)
    body = tokens_body(LENGTH, stream=True)
    call = asyncio.create_task(http.post(gateway.url + ROUTE, json=body, timeout=120))
    await wait_for(lambda: any(e.running_count for e in cluster.engines), what="the call running")
    first = next(i for i, e in enumerate(cluster.engines) if e.running_count)
    await killed_at(cluster, first, KILL_AT)
    response = await call
    assert response.status_code == 200
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    ids = [i for event in events[:-1] for i in event["choices"][0]["token_ids"]]
    assert len(ids) == LENGTH and events[-2]["choices"][0]["finish_reason"] == "length"
    [killed] = ledgers[first].records
    [continued] = ledgers[1 - first].records
    carried = continued.prompt_tokens - len(PROMPT)
    assert KILL_AT <= carried <= killed.completion_tokens
    assert carried + continued.completion_tokens == LENGTH


@pytest.mark.parametrize("path", ["/v1/chat/completions/render", "/v1/completions/render"])
async def test_vllms_renders_are_proxied_to_an_engine_without_admin_credentials(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, path: str
) -> None:
    """SkyRL's `render_chat_completion()` (no credentials): a template applied, nothing generated, so it is an
    open engine path, not engine control. The simulator does not serve renders: the engine's own 404 comes
    back, not the gateway's 401."""
    cluster = await make_cluster(api="vllm", engines=1)
    gateway = await make_gateway(cluster, admin_token="admin-secret")
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    response = await http.post(gateway.url + path, json=body)
    assert (response.status_code, response.text) == (404, "404: Not Found")  # aiohttp's own, from the engine
    control = await http.post(gateway.url + "/pause", params={"mode": "keep"})
    assert control.status_code == 401  # engine control still needs the admin token
