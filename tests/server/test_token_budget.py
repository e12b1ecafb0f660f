"""Session token budgets at the edge, over loopback HTTP on the simulator: `X-Rolloutgate-Max-Seq-Len` on the
front's routes, `POST /sessions {"max_seq_len"}` and `--session-max-seq-len` on the session API; each turn's
output limit capped so prompt + generated stays within the budget, ended by the engine with `length`, and the
answers for a prompt that already fills it (rolloutgate/token_budget.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MakeCluster, MakeGateway
from tests.sessions.fixtures import build_tiny_tokenizer

HEADER = "X-Rolloutgate-Max-Seq-Len"


async def budget_saved(http: httpx.AsyncClient, url: str) -> float:
    text = (await http.get(f"{url}/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "rolloutgate_budget_tokens_saved":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("rolloutgate_budget_tokens_saved_total is not exported")


def generate_body(prompt_len: int, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": list(range(11, 11 + prompt_len)),
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }


async def test_a_generate_is_capped_at_its_budget_and_ends_with_length(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    reply = await http.post(f"{gateway.url}/generate", json=generate_body(20, 50), headers={HEADER: "30"})
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (20, 10)  # 20 + 10 = the budget
    assert meta["finish_reason"]["type"] == "length"
    assert len(meta["output_token_logprobs"]) == 10
    # a call within its budget is sent as it came
    within = await http.post(f"{gateway.url}/generate", json=generate_body(20, 5), headers={HEADER: "30"})
    assert within.json()["meta_info"]["completion_tokens"] == 5
    assert await budget_saved(http, gateway.url) == 40  # asked 50, allowed 10


@pytest.mark.parametrize("stream", [False, True])
async def test_a_generate_whose_prompt_fills_its_budget_gets_zero_tokens_and_no_engine_call(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, stream: bool
) -> None:
    """What miles decides itself when its context budget is spent (no call, the sample truncated): SGLang's
    answer with no tokens and finish reason length."""
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    body = generate_body(30, 8, rid="miles-rid", stream=stream)
    reply = await http.post(f"{gateway.url}/generate", json=body, headers={HEADER: "30"})
    assert reply.status_code == 200, reply.text
    if stream:
        events = [line for line in reply.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]" and len(events) == 2
        answer = orjson.loads(events[0].removeprefix("data: "))
    else:
        answer = reply.json()
    assert (answer["text"], answer["output_ids"]) == ("", [])
    meta = answer["meta_info"]
    assert meta["id"] == "miles-rid" and meta["finish_reason"] == {"type": "length", "length": 0}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["output_token_logprobs"]) == (30, 0, [])
    assert cluster.engines[0].model.stats.requests_total == 0
    assert await budget_saved(http, gateway.url) == 8


async def test_a_chat_whose_prompt_fills_its_budget_is_a_400_the_clients_read_as_a_full_context(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """OpenAI routes: 400 context_length_exceeded, which no client retries and LiteLLM raises as its
    ContextWindowExceededError (what agents handle as a context that is full)."""
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    messages = [{"role": "user", "content": "x" * 400}]  # ~100 tokens by the gateway's estimate
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(
            model="sim-model", messages=messages, max_tokens=10, extra_headers={HEADER: "64"}
        )
    await sdk.close()
    assert info.value.code == "context_length_exceeded"
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(
            model="openai/sim-model",
            api_base=f"{gateway.url}/v1",
            api_key="unused",
            messages=messages,
            max_tokens=10,
            extra_headers={HEADER: "64"},
        )
    assert cluster.engines[0].model.stats.requests_total == 0


@pytest.mark.parametrize("value", ["0", "many"])
async def test_a_bad_budget_header_is_a_400(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, value: str
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    reply = await http.post(f"{gateway.url}/generate", json=generate_body(4, 4), headers={HEADER: value})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_override"


async def test_a_tokenized_session_never_generates_past_its_budget(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """With the gateway's tokenizer the prompt is counted exactly: prompt + generated = max_seq_len at the cap;
    the turn whose prompt fills the budget is a 400 and is not recorded."""
    gateway = await make_gateway(
        await make_cluster(engines=1), tokenizer=str(build_tiny_tokenizer(tmp_path / "tok"))
    )
    created = await http.post(f"{gateway.url}/sessions", json={"max_seq_len": 60})
    session_id = created.json()["session_id"]
    base_url = f"{gateway.url}/sessions/{session_id}/v1"
    sdk = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "what is the weather"}]
    reply = await sdk.chat.completions.create(
        model="sim-model", messages=messages, max_tokens=500, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 60
    messages += [
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "and tomorrow?"},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model="sim-model", messages=messages, max_tokens=500)
    await sdk.close()
    assert info.value.code == "context_length_exceeded"
    described = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()
    assert described["metadata"]["max_seq_len"] == 60 and len(described["records"]) == 1
    assert await budget_saved(http, gateway.url) == 500 - reply.usage.completion_tokens


async def test_the_servers_session_budget_and_a_tighter_header(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """miles creates sessions with `{}`: `--session-max-seq-len` gives them its budget; a turn's header can only
    tighten it. Without a tokenizer the prompt is the gateway's estimate (~4 characters a token)."""
    gateway = await make_gateway(await make_cluster(engines=1), session_max_seq_len=300)
    session_id = (await http.post(f"{gateway.url}/sessions", json={})).json()["session_id"]
    described = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()
    assert described["metadata"]["max_seq_len"] == 300
    url = f"{gateway.url}/sessions/{session_id}/v1/chat/completions"
    content = "y" * 399  # the gateway's estimate: 399 // 4 + 1 = 100 tokens
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}], "ignore_eos": True}
    first = await http.post(url, json={**body, "max_tokens": 1000})
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "length"
    assert first.json()["usage"]["completion_tokens"] == 300 - 100
    tighter = await http.post(url, json={**body, "max_tokens": 1000}, headers={HEADER.lower(): "150"})
    assert tighter.json()["usage"]["completion_tokens"] == 150 - 100


@pytest.mark.parametrize("body", [{"max_seq_len": 0}, {"max_seq_len": "4096"}, [1]])
async def test_a_bad_session_budget_is_a_400(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, body: Any
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    reply = await http.post(f"{gateway.url}/sessions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
