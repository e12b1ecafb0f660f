"""The engine pool's API in the miles router's dialect (server/workers.py): register by query or JSON body,
list, remove by URL; a prefill or decode worker is refused by name. Engines as they come (issue 31): an
SGLang-speaking stand-in with miles' MockSGLangServer's routes only is admitted with defaults; a URL that is
not listening yet is kept pending and joins when it answers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from rolloutgate.config import EngineSpec
from rolloutsim import SimCluster
from tests.engines.fakes import FakeEngine, serve_like_miles_mock
from tests.ports import port_of, reserved_port
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until


async def test_register_list_and_remove_as_miles_does(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster: SimCluster = await make_cluster(engines=2)
    first, second = cluster.urls
    gateway = await make_gateway(engines=[])
    added = await http.post(f"{gateway.url}/add_worker", params={"url": first})
    assert added.status_code == 201, added.text
    added = await http.post(f"{gateway.url}/add_worker", json={"url": second})  # a JSON body
    assert added.status_code == 201, added.text
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [first, second]}
    removed = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
    assert removed.status_code == 200 and removed.json()["removed"]["url"] == first
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [second]}
    missing = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"
    nameless = await http.post(f"{gateway.url}/remove_worker")
    assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "url"


@pytest.mark.looptime  # the simulator and the gateway on the loop's time: the generation ends when it is idle
async def test_each_worker_lists_the_requests_in_flight_on_it(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster: SimCluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    body = {"model": "sim-model", "prompt": "go", "max_tokens": 2_000, "ignore_eos": True, "stream": True}
    async with http.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass  # the first token: the request is on the engine
        (worker,) = (await http.get(f"{gateway.url}/workers")).json()["workers"]
        assert worker["in_flight"] == 1, worker
        async for _ in lines:
            pass
    (worker,) = (await http.get(f"{gateway.url}/workers")).json()["workers"]
    assert worker["in_flight"] == 0, worker


async def test_a_prefill_or_decode_worker_is_refused_by_name(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(engines=[])
    for worker_type in ("prefill", "decode"):
        refused = await http.post(
            f"{gateway.url}/workers", json={"url": cluster.urls[0], "worker_type": worker_type}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "unsupported_worker_type"
        refused = await http.post(
            f"{gateway.url}/add_worker", params={"url": cluster.urls[0], "worker_type": worker_type}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "worker_type"
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": []}
    regular = await http.post(
        f"{gateway.url}/workers", json={"url": cluster.urls[0], "worker_type": "regular"}
    )
    assert regular.status_code == 201, regular.text


# -- engines as they come: a stand-in without /server_info or /v1/models, a URL not listening yet -----------


async def test_a_stand_in_serving_only_generate_chat_and_health_is_admitted_with_defaults(
    make_gateway: MakeGateway, http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """miles' MockSGLangServer's routes and nothing else, given with `--engine` (detected) and as `sglang+`:
    each joins with the default capacity, says once in the log what it lacks, shows it in `/workers`, and
    serves chat and `/generate` through the gateway."""
    async with stand_in() as detected, stand_in() as named:
        with caplog.at_level(logging.WARNING, logger="rolloutgate.pool"):
            gateway = await make_gateway(
                engines=[EngineSpec.parse(detected.url), EngineSpec.parse(f"sglang+{named.url}")],
                default_capacity=5,
                health_interval=0.05,  # many health checks: the warning is still said once
            )
            workers = (await http.get(f"{gateway.url}/workers")).json()["workers"]
            assert sorted((w["url"], w["family"], w["capacity"], w["state"]) for w in workers) == sorted(
                [(detected.url, "sglang", 5, "healthy"), (named.url, "sglang", 5, "healthy")]
            )
            missing = ["/server_info", "/v1/models", "load (/metrics, /v1/loads)"]
            assert all(w["missing"] == missing for w in workers), workers
            for _ in range(2):
                chat = await http.post(
                    f"{gateway.url}/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "What is 1+3?"}]},
                )
                assert chat.status_code == 200, chat.text
                assert chat.json()["choices"][0]["message"]["content"] == "4"
                generated = await http.post(
                    f"{gateway.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {}}
                )
                assert generated.status_code == 200, generated.text
                assert generated.json()["text"] == "4"
            await wait_until(
                lambda: sum(r.path == "/health" for r in detected.requests) >= 3, "a few health checks"
            )
    said = [r.getMessage() for r in caplog.records if "joined as sglang with defaults" in r.getMessage()]
    assert len(said) == 2 and all("capacity 5 (--default-capacity)" in m for m in said), said
    assert any(detected.url in m for m in said) and any(named.url in m for m in said)


async def test_a_url_not_listening_yet_is_kept_pending_and_admitted_when_it_answers(
    make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(engines=[], health_interval=0.05)
    with reserved_port() as reservation:  # bound, not listening: connections to it are refused
        url = f"http://127.0.0.1:{port_of(reservation)}"
        added = await http.post(f"{gateway.url}/add_worker", params={"url": url})
        assert added.status_code == 202, added.text
        assert added.json()["status"] == "success" and added.json()["state"] == "pending"
        again = await http.post(f"{gateway.url}/add_worker", json={"url": url + "/"})  # idempotent
        assert again.status_code == 200 and again.json()["id"] == added.json()["id"]
        ours = await http.post(f"{gateway.url}/workers", json={"url": url})
        assert ours.status_code == 200 and ours.json()["id"] == added.json()["id"]
        assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [url]}
        (worker,) = (await http.get(f"{gateway.url}/workers")).json()["workers"]
        assert (worker["url"], worker["state"], worker["healthy"]) == (url, "pending", False)
        assert worker["attempts"] >= 1 and "no engine answers" in worker["error"], worker
        assert worker["in_flight"] == 0  # miles' router counts a pending worker as 0 too
        state = (await http.get(f"{gateway.url}/admin/state")).json()
        assert state["engines"] == [] and [p["url"] for p in state["pending_engines"]] == [url]
        metrics = (await http.get(f"{gateway.url}/metrics")).text
        assert f'rolloutgate_engine_state{{engine="{worker["id"]}",state="pending"}} 1.0' in metrics
        assert (await http.get(f"{gateway.url}/ready")).status_code == 503

        async with stand_in(port=port_of(reservation)):
            reservation.close()  # handed over: the stand-in listens on the port now

            async def joined() -> bool:
                workers = (await http.get(f"{gateway.url}/workers")).json()["workers"]
                return [(w["id"], w["state"]) for w in workers] == [(worker["id"], "healthy")]

            await wait_until(joined, "the engine joined once it listened")
            assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [url]}
            chat = await http.post(
                f"{gateway.url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert chat.status_code == 200, chat.text
            again = await http.post(f"{gateway.url}/add_worker", params={"url": url})
            assert again.status_code == 200 and again.json()["state"] == "healthy"
            assert len((await http.get(f"{gateway.url}/workers")).json()["workers"]) == 1


async def test_a_worker_that_never_joined_can_be_removed_by_url_or_id(
    make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(engines=[], health_interval=0.05)
    pool = gateway.context.pool
    with reserved_port() as first_port, reserved_port() as second_port:
        first, second = (f"http://127.0.0.1:{port_of(s)}" for s in (first_port, second_port))
        for url in (first, second):
            assert (await http.post(f"{gateway.url}/add_worker", params={"url": url})).status_code == 202
        tasks = [p.task for p in pool.pending.values()]
        removed = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
        assert removed.status_code == 200, removed.text
        assert removed.json()["removed"]["url"] == first and removed.json()["status"] == "success"
        second_id = pool.pending[second].engine_id
        removed = await http.delete(f"{gateway.url}/workers/{second_id}")
        assert removed.status_code == 200 and removed.json()["removed"]["state"] == "pending"
        assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": []}
        await wait_until(lambda: all(t is not None and t.done() for t in tasks), "no more probes")
        assert pool.pending == {} and pool.engines == {}
        missing = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"


async def test_an_engine_given_at_start_that_is_not_up_is_listed_pending(
    make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    with reserved_port() as reservation:
        url = f"http://127.0.0.1:{port_of(reservation)}"
        gateway = await make_gateway(engines=[EngineSpec(url=url, family="sglang")], health_interval=0.05)
        (worker,) = (await http.get(f"{gateway.url}/workers")).json()["workers"]
        assert (worker["url"], worker["family"], worker["state"]) == (url, "sglang", "pending")
        async with stand_in(port=port_of(reservation)):
            reservation.close()
            await wait_until(lambda: len(gateway.context.pool.engines) == 1, "the engine joined")
        assert gateway.context.pool.pending == {}


async def test_a_url_that_could_never_be_reached_is_refused_not_kept(
    make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(engines=[])
    for url in (
        "http://127.0.0.1:0",
        "http://127.0.0.1:70000",
        "http://a b:80",
        "http://h:1?x=1",
        "ftp://h:1",
    ):
        refused = await http.post(f"{gateway.url}/add_worker", params={"url": url})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_worker", url
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": []}


@contextlib.asynccontextmanager
async def stand_in(port: int = 0) -> AsyncIterator[FakeEngine]:
    """An engine answering as miles' MockSGLangServer does (tests/engines/fakes.py `serve_like_miles_mock`)."""
    engine = serve_like_miles_mock(FakeEngine())
    await engine.start(port)
    try:
        yield engine
    finally:
        await engine.close()
