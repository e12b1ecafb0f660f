"""Faults: injected at start-up, through `POST /sim/faults` (engine or cluster admin port), or from Python."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rolloutgate.sim import Fault
from rolloutgate.sim.faults import parse_fault_flag

from .conftest import ClusterFactory
from .helpers import post_json, read_sse, wait_running, wait_until

SCALE = 50.0

# the simulator runs on the loop's time (x SCALE): on a fake-time loop its seconds pass when the loop is idle, so
# "nothing happened" is checked long after it would have happened (LONG_AFTER_S), at no real cost
pytestmark = pytest.mark.looptime
LONG_AFTER_S = 60.0  # simulated seconds: a few-token call, were it let through, is answered in well under one


async def fault(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> list[dict[str, object]]:
    status, answer = await post_json(session, url + "/sim/faults", body)
    assert status == 200, answer
    listed = answer["faults"]
    assert isinstance(listed, list)
    return listed


async def test_freeze_keeps_connections_open_without_progress(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    body = {"text": "a", "rid": "f", "stream": True, "sampling_params": {"max_new_tokens": 400}}
    async with session.post(url + "/generate", json=body) as response:
        await response.content.readline()  # the first chunk
        listed = await fault(session, url, {"fault": "freeze"})
        assert listed == [{"kind": "freeze", "engine": 0}]
        req = engine.request("f")
        assert req is not None
        made = req.completion_tokens
        await asyncio.sleep(LONG_AFTER_S / SCALE)  # 400 tokens take ~4 s
        assert req.completion_tokens == made and not req.is_finished
        async with session.get(url + "/sim/state") as state:
            snapshot = await state.json()
        assert snapshot["frozen"] is True and snapshot["requests"]["f"]["completion_tokens"] == made
        assert not response.content.at_eof()  # the connection is still open
        await fault(session, url, {"clear": "freeze"})
        events = await read_sse(response)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["completion_tokens"] == 400


async def test_a_fault_with_a_duration_clears_itself(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    before = engine.now()
    await fault(session, url, {"fault": "freeze", "duration_s": 3.0})
    status, _ = await post_json(
        session, url + "/generate", {"text": "a", "rid": "late", "sampling_params": {"max_new_tokens": 3}}
    )
    late = engine.request("late")
    assert status == 200 and late is not None and late.first_token_at is not None
    assert late.first_token_at >= before + 3.0  # nothing ran until the freeze lifted by itself
    assert engine.faults == []


async def test_slow_multiplies_latency(make_cluster: ClusterFactory, session: aiohttp.ClientSession) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    await fault(session, cluster.urls[1], {"fault": "slow", "factor": 3})
    body = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 100}}
    _, normal = await post_json(session, cluster.urls[0] + "/generate", body)
    _, slow = await post_json(session, cluster.urls[1] + "/generate", body)
    ratio = slow["meta_info"]["e2e_latency"] / normal["meta_info"]["e2e_latency"]
    assert 2.9 <= ratio <= 3.1


async def test_crash_drops_connections_refuses_new_ones_and_restarts_on_clear(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE, admin_port=0)
    assert cluster.admin_url is not None
    url, engine = cluster.urls[0], cluster.engines[0]
    body = {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 20_000}}
    async with session.post(url + "/generate", json=body) as response:
        await response.content.readline()
        status, answer = await post_json(
            session, cluster.admin_url + "/sim/faults", {"engine": 0, "fault": "crash"}
        )
        assert status == 200 and {"kind": "crash", "engine": 0} in answer["faults"]
        with pytest.raises(aiohttp.ClientError):
            await read_sse(response)
    with pytest.raises(aiohttp.ClientConnectorError):
        await post_json(session, url + "/generate", {"text": "b"})
    assert engine.is_crashed and engine.running_count == 0
    assert (
        await post_json(
            session, cluster.urls[1] + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}
        )
    )[0] == 200
    async with session.delete(cluster.admin_url + "/sim/faults", params={"engine": "0"}) as cleared:
        assert cleared.status == 200
    await asyncio.wait_for(engine.wait_listening(), 5)
    status, _ = await post_json(
        session, url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200 and engine.url == url


async def test_stall_holds_one_request(make_cluster: ClusterFactory, session: aiohttp.ClientSession) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    await fault(session, url, {"fault": "stall", "rid": "stuck"})
    stuck = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "stuck", "sampling_params": {"max_new_tokens": 10}},
        )
    )
    status, _ = await post_json(
        session, url + "/generate", {"text": "b", "rid": "fine", "sampling_params": {"max_new_tokens": 50}}
    )
    assert status == 200
    async with session.get(url + "/sim/state", params={"rid": "stuck"}) as response:
        state = (await response.json())["request"]
    assert state["state"] == "running" and state["completion_tokens"] == 0
    assert not stuck.done()
    await fault(session, url, {"clear": "stall:stuck"})
    assert (await stuck)[1]["meta_info"]["completion_tokens"] == 10
    assert engine.faults == []


async def test_blackhole_accepts_and_never_starts(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    await fault(session, url, {"fault": "blackhole"})
    hole = asyncio.create_task(
        post_json(
            session, url + "/generate", {"text": "a", "rid": "h", "sampling_params": {"max_new_tokens": 3}}
        )
    )
    await wait_until(lambda: engine.waiting_count == 1)
    await asyncio.sleep(LONG_AFTER_S / SCALE)
    req = engine.request("h")
    assert req is not None and req.started_at is None and not hole.done()
    async with session.delete(url + "/sim/faults") as response:
        assert await response.json() == {"faults": []}
    assert (await hole)[0] == 200


async def test_refuse_on_generate_and_faults_at_start_up(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(engines=2, time_scale=SCALE, faults=[(1, Fault(kind="refuse", status=429))])
    assert (
        await post_json(
            session, cluster.urls[0] + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}
        )
    )[0] == 200
    status, body = await post_json(session, cluster.urls[1] + "/generate", {"text": "a"})
    assert status == 429 and "message" in body["error"]
    async with session.get(cluster.urls[1] + "/sim/faults") as response:
        assert (await response.json())["faults"] == [{"kind": "refuse", "status": 429, "engine": 1}]


async def test_state_lists_counts_and_requests(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, max_running_requests=1)
    url, engine = cluster.urls[0], cluster.engines[0]
    a = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "a", "sampling_params": {"max_new_tokens": 20_000}},
        )
    )
    await wait_running(engine)
    b = asyncio.create_task(post_json(session, url + "/generate", {"text": "b", "rid": "b"}))
    await wait_until(lambda: engine.waiting_count == 1)
    async with session.get(url + "/sim/state") as response:
        state = await response.json()
    assert state["running"] == 1 and state["waiting"] == 1 and state["generated_tokens_total"] > 0
    assert state["requests"]["a"]["state"] == "running" and state["requests"]["b"]["state"] == "waiting"
    assert state["time_scale"] == SCALE and state["now"] > 0
    engine.abort_all()
    await asyncio.gather(a, b)


async def test_bad_fault_bodies_are_400(make_cluster: ClusterFactory, session: aiohttp.ClientSession) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    for body in ({"fault": "explode"}, {"fault": "stall"}, {"fault": "slow", "factor": 0}, {}):
        status, _ = await post_json(session, cluster.urls[0] + "/sim/faults", body)
        assert status == 400


def test_fault_flags() -> None:
    assert parse_fault_flag("0:freeze") == ("0", Fault(kind="freeze"))
    assert parse_fault_flag("all:slow:4") == ("all", Fault(kind="slow", factor=4.0))
    assert parse_fault_flag("1:stall:rid-7") == ("1", Fault(kind="stall", rid="rid-7"))
    assert parse_fault_flag("0:refuse:429") == ("0", Fault(kind="refuse", status=429))
    assert parse_fault_flag("0:crash:30") == ("0", Fault(kind="crash", duration_s=30.0))
    for bad in ("freeze", "0:melt", "0:slow:x"):
        with pytest.raises(ValueError):
            parse_fault_flag(bad)
