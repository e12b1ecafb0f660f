"""The physics measured from outside, over HTTP, from simulated timestamps (robust on a loaded machine)."""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from rolloutsim.profiles import decode_step_s, make_config, prefill_chunk_s

from .conftest import ClusterFactory
from .helpers import post_json, wait_until

INCIDENT = make_config("incident")


async def state_of(session: aiohttp.ClientSession, url: str, rid: str) -> dict[str, object]:
    async with session.get(url + "/sim/state", params={"rid": rid}) as response:
        body = await response.json()
    request = body["request"]
    assert isinstance(request, dict)
    return request


async def test_a_lone_request_decodes_at_the_profile_rate(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(profile="incident", time_scale=200.0)
    status, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"input_ids": list(range(3, 13)), "sampling_params": {"max_new_tokens": 700}},
    )
    assert status == 200
    meta = body["meta_info"]
    rate = meta["completion_tokens"] / meta["e2e_latency"]
    assert abs(rate - 70.0) / 70.0 < 0.10
    assert abs(rate - 1 / decode_step_s(INCIDENT, 1, 360)) / rate < 0.02


async def test_a_100k_prefill_takes_30_to_40_s_and_starves_a_running_request(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(profile="incident", time_scale=200.0, record_token_times=True)
    url = cluster.urls[0]
    a = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"input_ids": list(range(3, 1003)), "rid": "A", "sampling_params": {"max_new_tokens": 20_000}},
        )
    )
    await wait_until(lambda: (r := cluster.engines[0].request("A")) is not None and r.completion_tokens > 50)
    status, b = await post_json(
        session,
        url + "/generate",
        {"input_ids": list(range(10_000, 110_000)), "rid": "B", "sampling_params": {"max_new_tokens": 1}},
    )
    assert status == 200
    assert 30.0 <= b["meta_info"]["e2e_latency"] <= 40.0
    b_state = await state_of(session, url, "B")
    a_state = await state_of(session, url, "A")
    start, end = b_state["started_at"], b_state["first_token_at"]
    assert isinstance(start, float) and isinstance(end, float)
    times = a_state["token_times"]
    assert isinstance(times, list)
    during = sum(1 for t in times if start < t <= end) / (end - start)
    assert 3.0 <= during <= 8.0
    # the profile's own figure: one decode step of A after each 512-token chunk of B
    chunks = [(s, min(512, 100_000 - s)) for s in range(0, 100_000, 512)]
    context_a = 1000 + len([t for t in times if t <= start])
    window = sum(prefill_chunk_s(INCIDENT, s, n) + decode_step_s(INCIDENT, 1, context_a) for s, n in chunks)
    assert abs(during - len(chunks) / window) / during < 0.10
    cluster.engines[0].abort("A")
    assert (await a)[1]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_a_sessions_next_turn_is_faster_on_the_engine_that_holds_its_prefix(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(engines=2, time_scale=50.0)
    warm, cold = cluster.urls
    prompt = list(range(100, 3100))
    _, turn1 = await post_json(
        session, warm + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20}}
    )
    history = prompt + turn1["output_ids"] + list(range(5000, 5050))
    body = {"input_ids": history, "sampling_params": {"max_new_tokens": 1}}
    _, same = await post_json(session, warm + "/generate", body)
    _, other = await post_json(session, cold + "/generate", body)
    assert same["meta_info"]["cached_tokens"] >= 3000
    assert other["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["e2e_latency"] < other["meta_info"]["e2e_latency"] / 3


async def test_abort_frees_a_slot_for_the_next_request(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=50.0, max_running_requests=1)
    url, engine = cluster.urls[0], cluster.engines[0]
    long = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "long", "sampling_params": {"max_new_tokens": 20_000}},
        )
    )
    await wait_until(lambda: engine.running_count == 1)
    queued = asyncio.create_task(
        post_json(
            session, url + "/generate", {"text": "b", "rid": "next", "sampling_params": {"max_new_tokens": 5}}
        )
    )
    await wait_until(lambda: engine.waiting_count == 1)
    await post_json(session, url + "/abort_request", {"rid": "long"})
    status, body = await queued
    assert status == 200 and body["meta_info"]["completion_tokens"] == 5
    first, second = engine.request("long"), engine.request("next")
    assert first is not None and second is not None and second.started_at is not None
    assert second.started_at == first.finished_at
    await long


async def test_time_scale_runs_simulated_time_faster(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(profile="incident", time_scale=100.0)
    tokens = math.floor(60.0 / decode_step_s(INCIDENT, 1, 100))  # about 60 simulated seconds of decode
    began = time.monotonic()
    _, body = await post_json(
        session,
        cluster.urls[0] + "/generate",
        {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": tokens}},
    )
    real = time.monotonic() - began
    assert 59.0 <= body["meta_info"]["e2e_latency"] <= 61.5
    assert 0.58 <= real <= 5.0  # 60 s at x100 is 0.6 s (upper bound loose for a loaded machine)
