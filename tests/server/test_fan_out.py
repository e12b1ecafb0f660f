"""`/abort_request {"abort_all": true}` through the gateway (server/fan_out.py), as miles ends a rollout step:
the calls waiting in the gateway get SGLang's abort answer at once, the engine answers what it runs itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import generate_body
from tests.sim.helpers import wait_until

SCALE = 100.0


def queue_depth_is(http: httpx.AsyncClient, url: str, depth: int) -> Callable[[], Awaitable[bool]]:
    """A predicate: at least `depth` calls wait in the gateway's queue (read from its state)."""

    async def reached() -> bool:
        return (await http.get(f"{url}/admin/state")).json()["queue_depth"] >= depth

    return reached


@pytest.mark.looptime
async def test_abort_all_answers_the_queue_at_once_and_reaches_the_engine(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, capacity=1)  # one call runs, the others wait in the gateway
    model = cluster.engines[0].model
    running = asyncio.create_task(
        http.post(f"{gateway.url}/generate", json=generate_body(100, 20_000), timeout=None)
    )
    await wait_until(lambda: any(r.completion_tokens > 10 for r in model.requests()))
    waiting = [
        asyncio.create_task(
            http.post(
                f"{gateway.url}/generate", json={**generate_body(50, 100), "rid": f"miles-{i}"}, timeout=None
            )
        )
        for i in range(3)
    ]
    chat = asyncio.create_task(
        http.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
            timeout=None,
        )
    )
    await wait_until(queue_depth_is(http, gateway.url, 4))
    loop = asyncio.get_running_loop()
    started = loop.time()
    aborted = await http.post(f"{gateway.url}/abort_request", json={"abort_all": True})
    assert aborted.status_code == 200
    answers = await asyncio.gather(*waiting)
    assert loop.time() - started < 1.0  # within one second (100 simulated), while the running call goes on
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert meta["id"] == f"miles-{i}" and meta["completion_tokens"] == 0
        assert meta["output_token_logprobs"] == []  # return_logprob: the list miles reads, empty
    refused = await chat
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "aborted"
    first = await running
    assert first.status_code == 200, first.text
    meta = first.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"  # the engine's own answer, with the output so far
    assert 0 < meta["completion_tokens"] < 20_000
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert (await http.get(f"{gateway.url}/admin/state")).json()["queue_depth"] == 0


@pytest.mark.looptime
async def test_a_bad_abort_request_is_a_400_and_nothing_is_aborted(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    response = await http.post(f"{gateway.url}/abort_request", json={"abort_all": "yes"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "abort_all"
    response = await http.post(f"{gateway.url}/abort_request", content=b"{not json")
    assert response.status_code == 400
    ok = await http.post(f"{gateway.url}/generate", json=generate_body(10, 5))
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 5


@pytest.mark.looptime
async def test_flush_cache_reaches_every_engine_and_says_which_did_not_flush(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster)

    async def warm() -> None:  # a prompt in each engine's prefix cache
        for url in cluster.urls:
            assert (await http.post(f"{url}/generate", json=generate_body(512, 2))).status_code == 200

    await warm()
    assert all(e.model.cache.size_tokens > 0 for e in cluster.engines)
    flushed = await http.post(f"{gateway.url}/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert [e.model.cache.size_tokens for e in cluster.engines] == [0, 0]
    await warm()
    busy = asyncio.create_task(
        http.post(f"{cluster.urls[0]}/generate", json=generate_body(10, 20_000), timeout=None)
    )
    await wait_until(lambda: bool(cluster.engines[0].model.requests()))
    refused = await http.get(f"{gateway.url}/flush_cache")
    assert refused.status_code == 400  # SGLang flushes an idle engine only
    assert "engine-0" in refused.text and "engine-1" not in refused.text
    assert cluster.engines[0].model.cache.size_tokens > 0 and cluster.engines[1].model.cache.size_tokens == 0
    bad = await http.get(f"{gateway.url}/flush_cache", params={"timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    await http.post(f"{cluster.urls[0]}/abort_request", json={"abort_all": True})
    await busy


@pytest.mark.looptime
async def test_a_clients_rid_reaches_the_engine_and_its_aborts_match_waiting_and_running_calls(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """miles' multi-LoRA abort: `{"rid": "<adapter>::", "prefix": true}`, to the engines directly or through the
    gateway, ends that adapter's calls and no other; an exact rid through the gateway ends that call."""
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, capacity=2)
    model = cluster.engines[0].model

    def call(rid: str) -> asyncio.Task[httpx.Response]:
        body = {**generate_body(50, 20_000), "rid": rid}
        return asyncio.create_task(http.post(f"{gateway.url}/generate", json=body, timeout=None))

    running_a, running_b = call("lora-a::1"), call("lora-b::1")
    await wait_until(lambda: len([r for r in model.requests() if r.completion_tokens > 5]) >= 2)
    assert sorted(r.rid.split("@")[0] for r in model.requests()) == ["lora-a::1", "lora-b::1"]
    waiting_a, waiting_exact = call("lora-a::2"), call("one-call")
    await wait_until(queue_depth_is(http, gateway.url, 2))
    # straight to the engine, as miles does: the running call of adapter a ends, b's goes on
    assert (
        await http.post(f"{cluster.urls[0]}/abort_request", json={"rid": "lora-a::", "prefix": True})
    ).is_success
    first = await running_a
    assert first.json()["meta_info"]["finish_reason"]["type"] == "abort"
    # through the gateway: the waiting call of adapter a, and one exact rid, end at once
    assert (
        await http.post(f"{gateway.url}/abort_request", json={"rid": "lora-a::", "prefix": True})
    ).is_success
    assert (await waiting_a).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await http.post(f"{gateway.url}/abort_request", json={"rid": "one-call"})).is_success
    exact = await waiting_exact
    assert exact.json()["meta_info"]["finish_reason"]["type"] == "abort", exact.text
    assert not running_b.done()
    # an exact rid through the gateway reaches the call running on the engine under its engine id
    assert (await http.post(f"{gateway.url}/abort_request", json={"rid": "lora-b::1"})).is_success
    last = await running_b
    assert last.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < last.json()["meta_info"]["completion_tokens"] < 20_000
    bad = await http.post(f"{gateway.url}/abort_request", json={"rid": ["a"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
