"""The OpenAI SDK and LiteLLM work against the gateway unchanged, streaming and non-streaming."""

from __future__ import annotations

import litellm
import openai
import pytest

from tests.server.conftest import MakeCluster, MakeGateway

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_openai_sdk_chat_and_completions(
    make_cluster: MakeCluster, make_gateway: MakeGateway, api: str
) -> None:
    gateway = await make_gateway(await make_cluster(engines=2, api=api))
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    chat = await client.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=12)
    assert chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage is not None and chat.usage.completion_tokens == 12

    stream = await client.chat.completions.create(
        model="sim-model",
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text
    assert usage is not None and usage.completion_tokens == 12

    completion = await client.completions.create(model="sim-model", prompt="Once upon", max_tokens=9)
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 9
    await client.close()


async def test_streaming_client_without_usage_gets_no_usage_frame(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    stream = await client.chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=5, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.choices for chunk in chunks)
    await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_litellm_chat(make_cluster: MakeCluster, make_gateway: MakeGateway, stream: bool) -> None:
    gateway = await make_gateway(await make_cluster(engines=2))
    response = await litellm.acompletion(
        model="openai/sim-model",
        api_base=f"{gateway.url}/v1",
        api_key="unused",
        messages=MESSAGES,
        max_tokens=10,
        stream=stream,
        timeout=30,
    )
    if stream:
        text = ""
        async for chunk in response:
            text += chunk.choices[0].delta.content or ""
    else:
        text = response.choices[0].message.content
    assert text
