"""Groups over HTTP (server/front.py, server/groups.py): the header and the /generate body field, siblings on
one engine, the field kept from the engine, a group aborted whole, the group and cache metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutgate.config import EngineSpec
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.engine_tap import EngineTap
from tests.server.users_path import generate_body
from tests.sim.helpers import wait_until

SCALE = 100.0


async def samples(http: httpx.AsyncClient, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's /metrics, by name and labels."""
    text = (await http.get(f"{url}/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.looptime
async def test_a_groups_siblings_share_one_engine_and_the_engine_never_sees_the_group_field(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    taps = [await EngineTap(url).start() for url in cluster.urls]
    try:
        engines = [EngineSpec(url=t.url, family="sglang") for t in taps]
        gateway = await make_gateway(cluster, engines=engines)
        body = {**generate_body(6000, 20), "rolloutgate_group": "prompt-7"}
        answers = await asyncio.gather(*(http.post(f"{gateway.url}/generate", json=body) for _ in range(4)))
        assert all(a.status_code == 200 for a in answers), answers[0].text
        per_engine = [len(t.generations()) for t in taps]
        assert sorted(per_engine) == [0, 4]  # all four on one engine
        assert all("rolloutgate_group" not in c.body for t in taps for c in t.calls)
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        headers = {"X-Rolloutgate-Group": "chat-1"}
        assert (await http.post(f"{gateway.url}/v1/chat/completions", json=chat, headers=headers)).is_success
        metrics = await samples(http, gateway.url)
        assert metrics[("rolloutgate_groups_total", (("outcome", "finished"),))] == 2
        assert metrics[("rolloutgate_group_completion_seconds_count", ())] == 2
        assert metrics[("rolloutgate_group_prefill_tokens_saved_total", ())] > 0
        busy = gateway.context.pool.engines
        prompt = {
            e: metrics.get(("rolloutgate_engine_prompt_tokens_total", (("engine", e),)), 0) for e in busy
        }
        cached = {
            e: metrics.get(("rolloutgate_engine_cached_tokens_total", (("engine", e),)), 0) for e in busy
        }
        assert sum(prompt.values()) >= 4 * 6000
        assert 0 < sum(cached.values()) <= sum(prompt.values())  # the siblings found the prompt cached
    finally:
        for tap in taps:
            await tap.close()


@pytest.mark.looptime
async def test_aborting_a_group_ends_its_running_and_queued_members_and_nothing_else(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, capacity=1)  # one call runs, the others wait in the gateway
    model = cluster.engines[0].model

    def call(group: str | None, new_tokens: int) -> asyncio.Task[httpx.Response]:
        body = generate_body(100, new_tokens)
        if group is not None:
            body["rolloutgate_group"] = group
        return asyncio.create_task(http.post(f"{gateway.url}/generate", json=body, timeout=None))

    running = call("g", 20_000)
    await wait_until(lambda: any(r.completion_tokens > 10 for r in model.requests()))
    other, queued = call(None, 5), call("g", 50)
    await wait_until(lambda: gateway.context.driver.core.stats().queue_depth >= 2)
    answer = await http.post(f"{gateway.url}/admin/abort_group?group=g")
    assert answer.status_code == 200 and answer.json() == {"group": "g", "aborted": 2}
    for member in (await running, await queued):
        assert member.status_code == 200, member.text
        assert member.json()["meta_info"]["finish_reason"]["type"] == "abort"
    finished = await other
    assert finished.status_code == 200 and finished.json()["meta_info"]["finish_reason"]["type"] == "length"
    again = await http.post(f"{gateway.url}/admin/abort_group", json={"group": "g"})
    assert again.json() == {"group": "g", "aborted": 0}
    metrics = await samples(http, gateway.url)
    assert metrics[("rolloutgate_groups_total", (("outcome", "aborted"),))] == 1
    assert metrics[("rolloutgate_aborts_sent_total", (("reason", "group_aborted"),))] == 1


@pytest.mark.parametrize(
    ("path", "kwargs", "param"),
    [
        ("/admin/abort_group", {}, "group"),
        ("/admin/abort_group", {"json": {"group": 7}}, "group"),
        ("/generate", {"json": {**generate_body(10, 2), "rolloutgate_group": ["a"]}}, "rolloutgate_group"),
        (
            "/v1/chat/completions",
            {
                "json": {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                "headers": {"X-Rolloutgate-Group": "x" * 300},
            },
            "X-Rolloutgate-Group",
        ),
    ],
)
async def test_a_bad_group_is_a_400_naming_it(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    path: str,
    kwargs: dict[str, object],
    param: str,
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    response = await http.post(f"{gateway.url}{path}", **kwargs)  # type: ignore[arg-type]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("header", ["X-Rolloutgate-Group", "x-rolloutgate-group"])
async def test_session_turns_join_their_group_whatever_the_header_case(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, header: str
) -> None:
    """A GRPO group of agent sessions: each sample's turn sent through its own session URL with the group
    header (HTTP header names are case-insensitive; httpx and aiohttp keep the case a client gives)."""
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 3}
    sessions = [(await http.post(f"{gateway.url}/sessions")).json()["session_id"] for _ in range(3)]
    answers = await asyncio.gather(
        *(
            http.post(f"{gateway.url}/sessions/{s}/v1/chat/completions", json=chat, headers={header: "g-1"})
            for s in sessions
        )
    )
    assert all(a.status_code == 200 for a in answers), answers[0].text
    metrics = await samples(http, gateway.url)
    assert metrics[("rolloutgate_groups_total", (("outcome", "finished"),))] == 1
    engines = {
        (await http.get(f"{gateway.url}/sessions/{s}")).json()["records"][0]["engine"] for s in sessions
    }
    assert len(engines) == 1  # the siblings on one engine
