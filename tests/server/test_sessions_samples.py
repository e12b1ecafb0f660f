"""`POST /sessions/{id}/samples` through the gateway, as miles collects a finished session: a safetensors
payload that the `safetensors` library decodes into miles' fields, token-exact against what the engine saw
and produced (a wire tap in front of the simulated SGLang engine records both)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
from safetensors.numpy import load

from rolloutgate.config import EngineSpec
from rolloutgate.server.app import GatewayServer
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.engine_tap import EngineTap
from tests.sessions.fixtures import build_tiny_tokenizer

MAX_TOKENS = 12


@pytest.fixture
async def tapped(make_cluster: MakeCluster, tmp_path: Path) -> AsyncIterator[tuple[EngineTap, str]]:
    cluster = await make_cluster(engines=1, stop_fraction=1.0)  # every turn ends with EOS: it completes
    tap = await EngineTap(cluster.urls[0]).start()
    yield tap, str(build_tiny_tokenizer(tmp_path / "tok"))
    await tap.close()


async def gateway_on(
    make_gateway: MakeGateway, tap: EngineTap, tokenizer: str, **settings: Any
) -> GatewayServer:
    return await make_gateway(
        engines=[EngineSpec(url=tap.url, family="sglang")], time_scale=100.0, tokenizer=tokenizer, **settings
    )


def decode(payload: bytes) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """miles' decode: the per-sample tensors beside the `_samples_meta` JSON; every tensor accounted for."""
    tensors = load(payload)
    meta = orjson.loads(tensors.pop("_samples_meta").tobytes())
    samples = []
    for i, entry in enumerate(meta["samples"]):
        for field, dtype in (
            ("tokens", np.int64),
            ("loss_mask", np.uint8),
            ("rollout_log_probs", np.float64),
        ):
            assert tensors[f"{field}.{i}"].dtype == dtype
        samples.append(
            {
                **entry,
                "tokens": tensors.pop(f"tokens.{i}").tolist(),
                "loss_mask": tensors.pop(f"loss_mask.{i}").tolist(),
                "rollout_log_probs": tensors.pop(f"rollout_log_probs.{i}").tolist(),
            }
        )
        assert set(entry["nulls"]) == {"rollout_routed_experts", "rollout_indexer_topk"}
    assert tensors == {}, f"tensors no sample names: {sorted(tensors)}"
    return samples, meta


async def run_session(
    url: str, session_id: str, turns: int, first: str = "what is the weather"
) -> list[dict[str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{session_id}/v1", api_key="unused")
    messages: list[dict[str, str]] = [{"role": "user", "content": first}]
    for turn in range(turns):
        reply = await client.chat.completions.create(
            model="sim-model", messages=messages, max_tokens=MAX_TOKENS
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"tool result {turn}: sunny"},
        ]
    await client.close()
    return messages


async def new_session(http: httpx.AsyncClient, url: str, *, turns: int) -> str:
    session_id: str = (await http.post(f"{url}/sessions")).json()["session_id"]
    await run_session(url, session_id, turns=turns)
    return session_id


@pytest.mark.parametrize(("route", "path"), [("generate", "/generate"), ("chat", "/v1/chat/completions")])
async def test_samples_are_token_exact_against_the_engine(
    tapped: tuple[EngineTap, str], make_gateway: MakeGateway, http: httpx.AsyncClient, route: str, path: str
) -> None:
    """Either way the gateway renders the prompt ids: to `/generate`, or to the chat endpoint as `input_ids` (the
    engine's parsers read the reply, as miles does)."""
    tap, tokenizer = tapped
    gateway = await gateway_on(make_gateway, tap, tokenizer, session_engine_route=route)
    session_id = await new_session(http, gateway.url, turns=3)
    calls = tap.generations()
    assert [c.path for c in calls] == [path] * 3
    answer = await http.post(f"{gateway.url}/sessions/{session_id}/samples", json={"max_seq_len": None})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/octet-stream"
    (sample,), meta = decode(answer.content)
    assert meta["empty_reason"] is None
    # the engine's own ids: each call's prompt, and the output it answered with (`[logprob, id, _]` triples)
    outputs = [c.output_ids for c in calls]
    logprobs = [c.output_logprobs for c in calls]
    prompts = [c.body["input_ids"] for c in calls]
    assert sample["tokens"] == prompts[-1] + outputs[-1]  # the last call saw everything before it
    first_prompt = len(prompts[0])
    assert sample["response_length"] == len(sample["tokens"]) - first_prompt
    mask, lps = [0] * len(sample["tokens"]), [0.0] * len(sample["tokens"])
    for prompt, output, lp in zip(prompts, outputs, logprobs, strict=True):
        assert sample["tokens"][len(prompt) : len(prompt) + len(output)] == output  # each output, in place
        mask[len(prompt) : len(prompt) + len(output)] = [1] * len(output)
        lps[len(prompt) : len(prompt) + len(output)] = lp
    assert sample["loss_mask"] == mask[first_prompt:]
    assert sample["rollout_log_probs"] == lps[first_prompt:]
    assert sum(sample["loss_mask"]) == sum(len(o) for o in outputs)
    assert sample["status"] == "completed"
    assert meta["session_metadata"]["accumulated_token_ids"] == sample["tokens"]
    spans = sample["weight_versions"]
    assert spans == [
        [{"version": "default", "abs_start": len(p), "abs_end": len(p) + len(o)}]
        for p, o in zip(prompts, outputs, strict=True)
    ]
    engine_metas = [c.meta_info for c in calls]
    assert sample["prefix_cache_info"] == {
        "cached_tokens": sum(m["cached_tokens"] for m in engine_metas),
        "total_prompt_tokens": sum(len(p) for p in prompts),
    }
    assert sample["response"]  # decoded by the gateway's tokenizer


async def test_records_carry_what_miles_assembler_reads(
    tapped: tuple[EngineTap, str], make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    tap, tokenizer = tapped
    gateway = await gateway_on(make_gateway, tap, tokenizer)
    session_id = await new_session(http, gateway.url, turns=2)
    records = (await http.get(f"{gateway.url}/sessions/{session_id}")).json()["records"]
    for record, call in zip(records, tap.generations(), strict=True):
        assert record["request"]["input_ids"] == call.body["input_ids"]
        meta = record["response"]["choices"][0]["meta_info"]
        engine = call.meta_info
        assert [t[:2] for t in meta["output_token_logprobs"]] == [
            t[:2] for t in engine["output_token_logprobs"]
        ]
        assert meta["finish_reason"]["type"] == engine["finish_reason"]["type"]
        assert meta["prompt_tokens"] == engine["prompt_tokens"]
        assert meta["cached_tokens"] == engine["cached_tokens"]
        assert meta["weight_version"] == engine["weight_version"]
    health = (await http.get(f"{gateway.url}/health")).json()
    assert health["status"] == "ok" and len(health["session_server_instance_id"]) == 32


async def test_max_seq_len_cuts_at_a_turn_and_empty_sessions_say_why(
    tapped: tuple[EngineTap, str], make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    tap, tokenizer = tapped
    gateway = await gateway_on(make_gateway, tap, tokenizer)
    samples_url = f"{gateway.url}/sessions/{{}}/samples"
    session_id = await new_session(http, gateway.url, turns=3)
    calls = tap.generations()
    prompts = [c.body["input_ids"] for c in calls]
    outputs = [c.output_ids for c in calls]
    # a later turn with two output tokens or more (the simulator's stop lengths are fixed by the prompt)
    k = next(i for i in range(1, len(calls)) if len(outputs[i]) >= 2)
    limit = len(prompts[k]) + 1  # inside turn k's output: it is cut to one token, and the merge ends there
    (sample,), _ = decode(
        (await http.post(samples_url.format(session_id), json={"max_seq_len": limit})).content
    )
    assert sample["tokens"] == prompts[k] + outputs[k][:1] and sample["status"] == "truncated"
    limit = len(prompts[k])  # turn k's prompt fills it: that turn and all after it go
    (sample,), _ = decode(
        (await http.post(samples_url.format(session_id), json={"max_seq_len": limit})).content
    )
    assert sample["tokens"] == prompts[k - 1] + outputs[k - 1] and sample["status"] == "completed"
    empty, meta = decode((await http.post(samples_url.format(session_id), json={"max_seq_len": 3})).content)
    assert empty == [] and meta["empty_reason"] == "all_truncated"
    fresh = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    empty, meta = decode((await http.post(samples_url.format(fresh), json={})).content)
    assert empty == [] and meta["empty_reason"] == "no_records"
    missing = await http.post(samples_url.format("no-such-session"), json={})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    bad = await http.post(samples_url.format(session_id), json={"max_seq_len": "long"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_seq_len"
    broken = await http.post(samples_url.format(session_id), content=b"{oops")
    assert broken.status_code == 400


async def test_a_chain_the_engine_re_rendered_cannot_be_assembled(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Without a tokenizer the engine renders each turn's history itself; where a turn's prompt does not
    extend the turns before it, miles' merge fails its prefix check: 422."""
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/{session_id}/v1", api_key="unused")
    messages = [{"role": "user", "content": "hello"}]
    for turn in range(2):
        reply = await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"more {turn}"},
        ]
    await client.close()
    answer = await http.post(f"{gateway.url}/sessions/{session_id}/samples", json={"max_seq_len": None})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "samples_unassemblable"


async def test_a_tree_session_gives_one_sample_per_kept_leaf(
    tapped: tuple[EngineTap, str], make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """miles' v2 with the `drop_same_prompt` picker: a retried turn (same prompt) is a sibling the picker drops;
    a rollback (another tool result) is a branch of its own. The shared first turn trains once, in the leaf committed first; the reward goes
    to every sample."""
    tap, tokenizer = tapped
    gateway = await gateway_on(
        make_gateway, tap, tokenizer, session_tree=True, session_picker="drop_same_prompt"
    )
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/sessions/{session_id}/v1", api_key="unused")
    first = [{"role": "user", "content": "what is the weather"}]
    reply = await client.chat.completions.create(model="sim-model", messages=first, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    history = [*first, {"role": "assistant", "content": reply.choices[0].message.content or ""}]
    sunny = [*history, {"role": "user", "content": "tool result: sunny"}]
    rainy = [*history, {"role": "user", "content": "tool result: rain"}]
    for messages in (sunny, sunny, rainy):  # turn 2; its retry; then a rollback with another tool result
        await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
    await client.close()
    calls = tap.generations()
    assert len(calls) == 4
    answer = await http.post(
        f"{gateway.url}/sessions/{session_id}/samples",
        json={"max_seq_len": None, "metadata": {"reward": 0.5}},
    )
    assert answer.status_code == 200, answer.text
    samples, meta = decode(answer.content)
    tree = meta["session_metadata"]["tree"]
    assert [n["parent"] for n in tree["nodes"]] == [None, 0, 0, 0]  # the first turn, then three siblings
    assert meta["session_metadata"]["agent"] == {"reward": 0.5}
    # kept: the retry (seq 2, the sunny prompt again, superseding seq 1) and the rollback (seq 3)
    assert sorted(s["metadata"]["leaf"]["node_id"] for s in samples) == [2, 3]
    by_leaf = {s["metadata"]["leaf"]["node_id"]: s for s in samples}
    for seq, call in ((2, calls[2]), (3, calls[3])):
        output = call.output_ids
        assert by_leaf[seq]["tokens"] == call.body["input_ids"] + output
        assert by_leaf[seq]["reward"] == 0.5
    first_output = len(calls[0].output_ids)
    assert by_leaf[2]["loss_mask"][:first_output] == [1] * first_output  # committed first: it owns turn 1
    assert by_leaf[3]["loss_mask"][:first_output] == [0] * first_output
