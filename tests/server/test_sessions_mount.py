"""The session API mounted on the gateway: agents use `.../sessions/{id}/v1` with the OpenAI SDK unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MakeCluster, MakeGateway
from tests.sessions.fixtures import build_tiny_tokenizer


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_session_turns_are_recorded_with_affinity(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, api: str
) -> None:
    cluster = await make_cluster(engines=2, api=api)
    gateway = await make_gateway(cluster)
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/{session_id}/v1", api_key="unused")
    messages: list[dict[str, str]] = [{"role": "user", "content": "first question"}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=6)
        content = reply.choices[0].message.content
        assert content
        assert getattr(reply.choices[0], "logprobs", None) is None  # not asked for: stripped
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"follow-up {turn}"},
        ]
    await client.close()

    record = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()
    turns = record["records"]
    assert len(turns) == 3
    assert len({t["engine"] for t in turns}) == 1  # affinity: one engine served the whole session
    assert all(len(t["output_token_ids"]) == 6 for t in turns)
    # Without a tokenizer the engine re-renders the history each turn, so the chain is not token-exact.
    assert (await http.get(f"{gateway.url}/sessions/{session_id}/trajectory")).status_code == 409

    assert (await http.delete(f"{gateway.url}/sessions/{session_id}")).status_code in (200, 204)
    gone = await http.get(f"{gateway.url}/sessions/{session_id}")
    assert gone.status_code in (404, 410)


async def test_token_in_token_out_trajectory_through_the_gateway(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    tokenizer_dir = build_tiny_tokenizer(tmp_path / "tok")
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster, tokenizer=str(tokenizer_dir))
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/{session_id}/v1", api_key="unused")
    messages: list[dict[str, str]] = [{"role": "user", "content": "what is the weather"}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=5)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"and then {turn}"},
        ]
    await client.close()
    records = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()["records"]
    engine_ids: list[int] = []
    for record in records:
        engine_ids = record["prompt_token_ids"] + record["output_token_ids"]
    trajectory = (await http.get(f"{gateway.url}/sessions/{session_id}/trajectory")).json()
    # the last turn's prompt extends every earlier turn: the trajectory is exactly what the engine saw
    assert trajectory["token_ids"] == engine_ids
    assert sum(trajectory["loss_mask"]) == 15
    assert len({r["engine"] for r in records}) == 1


async def test_a_turn_the_engine_cannot_stream_is_watched_by_engine_level_progress(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Recorded-mode turns ask SGLang for return_meta_info, which it will not stream: no per-request progress
    until the end. Engine-level progress (its load) must stand in, or a turn longer than stall_timeout would
    be taken for a hang."""
    cluster = await make_cluster(engines=2, time_scale=10.0)
    gateway = await make_gateway(cluster, stall_timeout=2.0)
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    reply = await http.post(
        f"{gateway.url}/sessions/{session_id}/v1/chat/completions",
        json={
            "model": "sim-model",
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 600,
            "ignore_eos": True,
        },
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 600
    [record] = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()["records"]
    assert record["timing"]["attempts"] == 1
    assert record["timing"]["wall_s"] > 2.0 * 2  # it outlived the stall timeout twice over
    assert len(gateway.context.pool.healthy()) == len(gateway.context.pool.engines)


@pytest.mark.parametrize("client", ["openai", "litellm"])
async def test_a_session_turn_that_times_out_after_keepalive_runs_once(
    make_cluster: MakeCluster, make_gateway: MakeGateway, tmp_path: Path, client: str
) -> None:
    """A turn whose charged time runs out after keep-alive committed its 200: the agent's client, retries on,
    raises once, and the engine ran one generation (a cut connection would have made both clients retry)."""
    cluster = await make_cluster(engines=1, time_scale=100.0)
    gateway = await make_gateway(
        cluster, tokenizer=str(build_tiny_tokenizer(tmp_path / "tok")), timeout=20.0, keepalive_interval=2.0
    )
    model = cluster.engines[0].model
    async with httpx.AsyncClient(timeout=60) as http:
        session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    base_url = f"{gateway.url}/sessions/{session_id}/v1"
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "a long answer"}], "max_tokens": 30_000}
    if client == "openai":
        sdk = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=2)
        with pytest.raises(json.JSONDecodeError):  # the error object, then a second JSON value
            await sdk.chat.completions.create(model="sim-model", extra_body={"ignore_eos": True}, **body)
        await sdk.close()
    else:
        litellm = pytest.importorskip("litellm")
        with pytest.raises(
            litellm.InternalServerError
        ):  # its text says "Retried: 3 times"; the engine says once
            await litellm.acompletion(
                model="openai/sim-model",
                api_base=base_url,
                api_key="unused",
                num_retries=3,
                ignore_eos=True,
                **body,
            )
    assert model.stats.requests_total == 1
