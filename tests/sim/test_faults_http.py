"""Faults: injected at start-up, through `POST /sim/faults` (engine or cluster admin port), or from Python."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rolloutsim import Fault
from rolloutsim.faults import parse_fault_flag

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
    for body in (
        {"fault": "explode"},
        {"fault": "stall"},
        {"fault": "slow", "factor": 0},
        {"fault": "compile"},  # a compile needs its length
        {"fault": "restart", "duration_s": 5, "down_s": -1},
        {},
    ):
        status, _ = await post_json(session, cluster.urls[0] + "/sim/faults", body)
        assert status == 400


def test_fault_flags() -> None:
    assert parse_fault_flag("0:freeze") == ("0", Fault(kind="freeze"))
    assert parse_fault_flag("all:slow:4") == ("all", Fault(kind="slow", factor=4.0))
    assert parse_fault_flag("1:stall:rid-7") == ("1", Fault(kind="stall", rid="rid-7"))
    assert parse_fault_flag("0:refuse:429") == ("0", Fault(kind="refuse", status=429))
    assert parse_fault_flag("0:crash:30") == ("0", Fault(kind="crash", duration_s=30.0))
    assert parse_fault_flag("all:compile:120") == ("all", Fault(kind="compile", duration_s=120.0))
    assert parse_fault_flag("0:restart:90") == ("0", Fault(kind="restart", duration_s=90.0))
    for bad in ("freeze", "0:melt", "0:slow:x", "0:compile", "0:restart"):  # compile, restart: a length
        with pytest.raises(ValueError):
            parse_fault_flag(bad)


# --- busy or dead: what a liveness check sees (docs/reliability.md, "Busy is not dead") ----------------------


async def status_within(
    session: aiohttp.ClientSession, url: str, simulated_s: float, scale: float
) -> int | None:
    """The status of a GET answered within `simulated_s`, else None (it hangs)."""
    try:
        async with asyncio.timeout(simulated_s / scale):
            async with session.get(url) as response:
                return response.status
    except TimeoutError:
        return None


async def test_a_compile_holds_the_first_client_step_and_the_scheduler_but_not_health_probes_shapes(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, faults=[Fault(kind="compile", duration_s=120.0)])
    url, engine = cluster.urls[0], cluster.engines[0]
    assert await status_within(session, url + "/health", 30.0, SCALE) == 200  # a probe's shape: no compile
    assert [f.kind for f in engine.faults] == ["compile"]
    sent_at = engine.now()
    first = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"text": "a", "rid": "first", "sampling_params": {"max_new_tokens": 4}},
        )
    )
    await wait_running(engine)
    # the scheduler is inside the compiling forward pass: its control round trip and the health probe wait
    assert await status_within(session, url + "/get_load", 30.0, SCALE) is None
    assert await status_within(session, url + "/health", 30.0, SCALE) == 503  # SGLang's own 20 s, no output
    async with session.get(url + "/metrics") as metrics:  # served beside the scheduler: frozen gauges
        assert metrics.status == 200
    status, _ = await first
    request = engine.request("first")
    assert status == 200 and request is not None and request.first_token_at is not None
    assert request.first_token_at - sent_at >= 120.0
    assert await status_within(session, url + "/get_load", 1.0, SCALE) == 200
    later_sent = engine.now()
    status, answer = await post_json(
        session, url + "/generate", {"text": "b", "rid": "later", "sampling_params": {"max_new_tokens": 4}}
    )
    assert status == 200 and answer["meta_info"]["e2e_latency"] < 1.0  # compiled once
    assert engine.now() - later_sent < 1.0 and engine.faults == []


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_a_wedge_answers_health_and_generates_nothing(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, api: str
) -> None:
    cluster = await make_cluster(time_scale=SCALE, api=api)
    url, engine = cluster.urls[0], cluster.engines[0]
    engine.set_fault(Fault(kind="wedge"))
    body = {"prompt": "a", "model": "sim-model", "max_tokens": 5}
    stuck = asyncio.create_task(post_json(session, url + "/v1/completions", body))
    await wait_until(lambda: engine.running_count + engine.waiting_count == 1)
    await asyncio.sleep(LONG_AFTER_S / SCALE)
    assert not stuck.done() and engine.generated_tokens_total == 0
    assert await status_within(session, url + "/health", 1.0, SCALE) == 200
    if api == "sglang":
        assert await status_within(session, url + "/get_load", 5.0, SCALE) is None
    engine.clear_faults("wedge")
    status, answer = await stuck
    assert status == 200 and answer["usage"]["completion_tokens"] == 5


async def test_a_restart_drops_everything_refuses_then_answers_503_then_serves(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    body = {"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 20_000}}
    async with session.post(url + "/generate", json=body) as response:
        await response.content.readline()
        started_at = engine.now()
        await fault(session, url, {"fault": "restart", "down_s": 10.0, "duration_s": 30.0})
        with pytest.raises(aiohttp.ClientError):
            await read_sse(response)
    with pytest.raises(aiohttp.ClientConnectorError):
        await post_json(session, url + "/generate", {"text": "b"})
    assert engine.running_count == 0 and engine.is_starting
    await asyncio.wait_for(engine.wait_listening(), 15.0 / SCALE)
    assert engine.now() - started_at >= 10.0
    for path in ("/health", "/ready", "/ping"):
        assert await status_within(session, url + path, 1.0, SCALE) == 503, path
    status, _ = await post_json(
        session, url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 503
    await wait_until(lambda: not engine.is_starting, timeout_s=40.0 / SCALE)
    assert engine.now() - started_at >= 40.0
    assert await status_within(session, url + "/health", 5.0, SCALE) == 200
    status, _ = await post_json(
        session, url + "/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}
    )
    assert status == 200 and engine.url == url
