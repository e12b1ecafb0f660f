"""miles against the gateway: every call of reference/miles.md, in miles' order, each answer read as miles reads it.

One rollout step of an agentic RL job: the engines register themselves from the cluster network (no token:
`--trust-network`), the rollout lists them, runs agent sessions (OpenAI SDK at `/sessions/{id}/v1`, token-in
token-out with the gateway's tokenizer) and plain TITO `/generate` calls; the trainer pauses, flushes, updates
and continues each engine directly, unannounced, while a long call runs; the rollout scrapes `/engine_metrics`,
scores prompts (`/flush_cache`, batch `/generate` with `logprob_start_len`), ends the step with `abort_all`,
collects each session's samples (safetensors) and deletes it; the engines remove themselves (the three ways
miles' SGLangEngine does, by router version). Simulated SGLang engines, time-scaled x20, on a fake-time loop
(looptime): the minute of the update and the calls' decode pass when the loop is idle, at no real cost.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import openai
import orjson
import pytest
from safetensors.numpy import load

from benchmarks.perf.rl_shape.plan import request_body
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import final_timing, quarantines
from tests.sessions.fixtures import build_tiny_tokenizer
from tests.sim.helpers import wait_until

SCALE = 20.0
ADMIN_TOKEN = "trainer-only-4f2a"


def tito_body(input_ids: list[int], max_new_tokens: int, rid: str) -> dict[str, Any]:
    """miles' `/generate` (reference/miles.md; the body `make bench-rl` sends), with miles' own rid."""
    return {**request_body(input_ids, max_new_tokens), "rid": rid}


def read_as_miles(answer: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """What miles' generate reads: text, `[logprob, token_id, _]` triples, the finish type, the counters."""
    meta = answer["meta_info"]
    assert isinstance(answer["text"], str)
    assert isinstance(meta["weight_version"], str)
    assert all(isinstance(meta[k], int) for k in ("cached_tokens", "prompt_tokens", "completion_tokens"))
    triples = meta["output_token_logprobs"]
    assert len(triples) == meta["completion_tokens"]
    return [t[1] for t in triples], [t[0] for t in triples], meta["finish_reason"]["type"]


@pytest.mark.looptime
async def test_one_rollout_step_as_miles_makes_it(
    make_cluster: MakeCluster, make_gateway: MakeGateway, tmp_path: Path
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE, stop_fraction=1.0)
    tokenizer = build_tiny_tokenizer(tmp_path / "tok")
    gateway = await make_gateway(
        engines=[],
        time_scale=SCALE,
        tokenizer=str(tokenizer),
        admin_token=ADMIN_TOKEN,  # the admin API is the trainer's, and stays behind the token
        trusted_networks=["127.0.0.0/8"],  # the cluster network: loopback here
        capacity=4,
    )
    router = gateway.url
    first, second = cluster.urls
    async with httpx.AsyncClient(timeout=120) as miles:  # miles' clients send no token
        # -- engines register themselves (SGLangEngine._init_normal: new router, then miles-router dialect)
        registered = await miles.post(f"{router}/workers", json={"url": first, "worker_type": "regular"})
        assert registered.is_success, registered.text
        registered = await miles.post(f"{router}/add_worker", params={"url": second})
        assert registered.is_success, registered.text
        assert (await miles.get(f"{router}/admin/state")).status_code == 401  # trust covers workers only

        # -- the rollout finds the engines and the session server
        assert (await miles.get(f"{router}/list_workers")).json()["urls"] == [first, second]
        workers = (await miles.get(f"{router}/workers")).json()["workers"]
        assert [w["url"] for w in workers] == [first, second] and all(w["id"] for w in workers)
        health = (await miles.get(f"{router}/health")).json()
        assert health["status"] == "ok" and health["session_server_instance_id"]

        # -- agent sessions (miles' OpenAIEndpointTracer: POST /sessions, the agent at /sessions/{id}/v1)
        sessions = []
        for agent in range(2):
            session_id = (await miles.post(f"{router}/sessions", json={})).json()["session_id"]
            sessions.append(session_id)
            client = openai.AsyncOpenAI(base_url=f"{router}/sessions/{session_id}/v1", api_key="unused")
            messages: list[Any] = [{"role": "user", "content": f"agent {agent}: what is the weather"}]
            for turn in range(2):
                reply = await client.chat.completions.create(
                    model="sim-model", messages=messages, max_tokens=8
                )
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": f"tool result {turn}: sunny"},
                ]
            await client.close()

        # -- plain TITO calls with the routing key; one long one runs through the trainer's update
        routing = {"X-SMG-Routing-Key": "group-3"}
        short = await miles.post(
            f"{router}/generate", json=tito_body(list(range(1, 300)), 16, "g3::0"), headers=routing
        )
        assert short.status_code == 200, short.text
        ids, logprobs, finish = read_as_miles(short.json())
        assert finish in ("stop", "length") and len(ids) == len(logprobs) > 0
        long_body = tito_body(list(range(1, 2000)), 3_000, "g3::1")
        long_body["sampling_params"]["ignore_eos"] = True  # runs to its 3,000 tokens
        long_call = asyncio.create_task(miles.post(f"{router}/generate", json=long_body, headers=routing))
        await wait_until(
            lambda: any(r.completion_tokens > 100 for e in cluster.engines for r in e.model.requests())
        )

        # -- the trainer's weight update, on each engine directly (update_weight mixins), nobody tells the gateway
        for url in (first, second):
            paused = await miles.post(f"{url}/pause_generation", json={"mode": "retract"})
            assert paused.is_success, paused.text
        await asyncio.sleep(60 / SCALE)  # the update takes a minute: past the 60 s stall timeout
        for url, engine in zip((first, second), cluster.engines, strict=True):
            # upstream SGLang refuses to flush while retracted requests wait in its queue (400; the simulator
            # is upstream's); miles' own SGLang branch flushes (sglang PR #31962). Nothing here depends on it.
            holds_retracted = bool(engine.model.requests())
            assert (await miles.get(f"{url}/flush_cache")).status_code == (400 if holds_retracted else 200)
            updated = await miles.post(f"{url}/update_weights_from_disk", json={"model_path": "/ckpt/step-1"})
            assert updated.is_success, updated.text
            version = await miles.post(
                f"{url}/update_weight_version", json={"new_version": "1", "abort_all_requests": False}
            )
            assert version.is_success, version.text
            assert (await miles.post(f"{url}/continue_generation", json={})).is_success
        answer = await long_call
        assert answer.status_code == 200, answer.text
        ids, _, _ = read_as_miles(answer.json())
        assert len(ids) == 3_000
        timing = final_timing(answer)
        assert timing["paused"] >= 30, timing  # the pause shows, uncharged
        assert await quarantines(miles, router) == 0

        # -- wandb's scrape of the engines' metrics, through the router
        scraped = await miles.get(f"{router}/engine_metrics")
        assert scraped.status_code == 200 and 'engine_url="' + first + '"' in scraped.text

        # -- scoring: flush, then a batch of prompts with no new tokens, scored from logprob_start_len
        assert (await miles.post(f"{router}/flush_cache")).status_code == 200
        prompts = [list(range(5, 40)), list(range(50, 90))]
        scored = await miles.post(
            f"{router}/generate",
            json={
                "input_ids": prompts,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        )
        assert scored.status_code == 200, scored.text
        for item, prompt in zip(scored.json(), prompts, strict=True):
            assert [t[1] for t in item["meta_info"]["input_token_logprobs"]] == prompt

        # -- the step ends: abort_all to every engine (miles' abort(); with the patch of docs/miles.md the
        #    router too), while calls run on the engines and wait in the gateway; then every one is answered
        step_end = [tito_body(list(range(1, 100 + i)), 20_000, f"s::{i}") for i in range(10)]
        for body in step_end:
            body["sampling_params"]["ignore_eos"] = True  # none ends before the abort
        pending = [asyncio.create_task(miles.post(f"{router}/generate", json=body)) for body in step_end]
        trainer = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        async def calls_wait_in_the_gateway() -> bool:  # capacity 4 per engine, 10 calls
            return (await miles.get(f"{router}/admin/state", headers=trainer)).json()["queue_depth"] >= 2

        await wait_until(calls_wait_in_the_gateway)
        loop = asyncio.get_running_loop()
        started = loop.time()
        aborts = [
            miles.post(f"{url}/abort_request", json={"abort_all": True}) for url in (router, first, second)
        ]
        assert all(r.status_code == 200 for r in await asyncio.gather(*aborts))
        answers = await asyncio.gather(*pending)
        assert loop.time() - started < 5.0  # fake seconds: 100 simulated, far less than 20,000 tokens take
        for response in answers:
            assert response.status_code == 200, response.text
            assert (
                response.json()["meta_info"]["finish_reason"]["type"] == "abort"
            )  # partial rollout keeps them

        # -- each session's samples, decoded as miles' codec decodes them, then the session is deleted
        for session_id in sessions:
            payload = await miles.post(f"{router}/sessions/{session_id}/samples", json={"max_seq_len": 4096})
            assert (
                payload.status_code == 200 and payload.headers["content-type"] == "application/octet-stream"
            )
            tensors = load(payload.content)
            meta = orjson.loads(tensors.pop("_samples_meta").tobytes())
            assert meta["empty_reason"] is None and len(meta["samples"]) == 1
            (entry,) = meta["samples"]
            assert tensors["tokens.0"].dtype == np.int64 and tensors["loss_mask.0"].dtype == np.uint8
            assert tensors["rollout_log_probs.0"].dtype == np.float64
            assert (
                len(tensors["loss_mask.0"]) == len(tensors["rollout_log_probs.0"]) == entry["response_length"]
            )
            assert entry["status"] == "completed" and entry["weight_versions"]
            assert set(entry["nulls"]) == {"rollout_routed_experts", "rollout_indexer_topk"}
            assert (await miles.delete(f"{router}/sessions/{session_id}")).status_code == 204

        # -- the engines remove themselves: GET /workers + DELETE by id; miles-router dialect; sglang-router
        #    before 0.3 (DELETE /workers/<quoted url>)
        workers = (await miles.get(f"{router}/workers")).json()["workers"]
        worker_id = next(w["id"] for w in workers if w["url"] == first)
        assert (await miles.delete(f"{router}/workers/{worker_id}")).is_success
        assert (await miles.post(f"{router}/remove_worker", params={"url": second})).is_success
        assert (await miles.get(f"{router}/list_workers")).json()["urls"] == []
        assert (await miles.post(f"{router}/workers", json={"url": first})).is_success
        removed = await miles.delete(f"{router}/workers/{quote(first, safe='')}")
        assert removed.is_success, removed.text
        assert (await miles.get(f"{router}/list_workers")).json()["urls"] == []
