"""Graceful shutdown: stop accepting, let in-flight requests finish within `shutdown_grace`, hand the rest
back with a 503 (Retry-After) so clients retry elsewhere, abort their generations, and exit."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.reliability.conftest import Proc, add_figure, bump_figure, spawn_gateway, wait_for
from tests.server.conftest import MakeCluster, MakeGateway

pytestmark = pytest.mark.reliability

SCALE = 10.0


def chat(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def sse(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[str]:
    async with http.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_shutdown_lets_in_flight_requests_finish_and_refuses_new_work(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, shutdown_grace=300.0, keepalive_interval=0)  # 30 s real
    url = gateway.url
    async with httpx.AsyncClient(timeout=30) as kept:  # holds an idle keep-alive connection
        assert (await kept.get(f"{url}/health")).status_code == 200
        plain = [
            asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat(300))) for _ in range(4)
        ]
        streams = [asyncio.create_task(sse(http, url, chat(300))) for _ in range(2)]
        await wait_for(lambda: cluster.engines[0].running_count == 6, what="six requests running")
        started = time.monotonic()
        stopping = asyncio.create_task(gateway.stop())
        await wait_for(lambda: gateway.context.draining)
        # a new request on an open connection: 503 + Retry-After, so the client retries elsewhere
        refused = await kept.post(f"{url}/v1/chat/completions", json=chat(4))
        assert refused.status_code == 503, refused.text
        assert refused.headers["Retry-After"] == "1"
        assert "shutting down" in refused.json()["error"]["message"]
        # a new connection: refused (the listening socket is closed)
        with pytest.raises(httpx.ConnectError):
            await httpx.AsyncClient().post(f"{url}/v1/chat/completions", json=chat(4))
        for response in await asyncio.gather(*plain):
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 300
        for lines in await asyncio.gather(*streams):
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
        await stopping
        took = time.monotonic() - started
    assert took < 15, f"shutdown took {took:.1f} s with 30 s of grace: it did not stop when work was done"
    add_figure("shutdown.drained", {"in_flight_finished": 6, "refused_new": 1, "seconds": round(took, 2)})
    bump_figure("faults_survived.graceful_shutdown_drain", 6)


async def test_shutdown_past_the_grace_hands_unfinished_requests_back_with_503(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, shutdown_grace=10.0, keepalive_interval=2.0)  # 1 s, 0.2 s real
    url = gateway.url
    long = chat(20_000)  # ~22 s real: far past the grace
    no_keepalive = asyncio.create_task(
        http.post(f"{url}/v1/chat/completions", json=long, headers={"X-Rolloutgate-Keepalive": "off"})
    )
    stream = asyncio.create_task(sse(http, url, long))
    await wait_for(lambda: cluster.engines[0].generated_tokens_total > 200, what="tokens flowing")
    with_keepalive = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=long))
    await wait_for(lambda: cluster.engines[0].running_count == 3, what="three running")
    await asyncio.sleep(0.5)  # the keep-alive client has its 200 headers and some spaces by now
    started = time.monotonic()
    await gateway.stop()
    took = time.monotonic() - started
    # no keep-alive yet: a real 503 the SDKs retry (with Retry-After)
    plain = await no_keepalive
    assert plain.status_code == 503, plain.text
    assert plain.headers["Retry-After"] == "1"
    assert "shut down" in plain.json()["error"]["message"]
    # keep-alive had committed a 200: the error object first in the body, framed so every client raises
    kept = await with_keepalive
    assert kept.status_code == 200
    first = orjson.loads(kept.content.strip().split(b"\n")[0])
    assert first["error"]["type"] == "service_unavailable"
    # a stream already under way: an SSE error event, then [DONE]
    lines = await stream
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    # the generations were aborted on the engine, and the stop kept to its bound (grace + hand-back)
    await wait_for(lambda: cluster.engines[0].running_count == 0, what="generations aborted on the engine")
    assert cluster.engines[0].generated_tokens_total < 3 * 20_000
    assert took < 1.0 + 5.0 + 3.0, took
    add_figure("shutdown.past_grace", {"handed_back_503": 3, "seconds": round(took, 2)})
    bump_figure("faults_survived.graceful_shutdown_hand_back", 3)


async def test_sigterm_drains_hands_back_and_exits(procs: list[Proc], tmp_path: Path) -> None:
    """`rolloutgate serve` on SIGTERM: short requests finish, a long one gets a 503, the process exits 0."""
    gateway = spawn_gateway(
        ["--sim", "1", "--time-scale", str(SCALE), "--shutdown-grace", "30", "--keepalive-interval", "0"],
        tmp_path / "gateway.log",
    )
    procs.append(gateway)
    async with httpx.AsyncClient(timeout=60) as http:
        url = f"{gateway.url}/v1/chat/completions"
        short = [asyncio.create_task(http.post(url, json=chat(200))) for _ in range(3)]
        long = asyncio.create_task(http.post(url, json=chat(20_000)))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        gateway.popen.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*short)
        handed_back = await long
        code = await asyncio.to_thread(gateway.popen.wait, 30)
        took = time.monotonic() - started
    assert [r.status_code for r in results] == [200, 200, 200]
    assert handed_back.status_code == 503 and handed_back.headers["Retry-After"] == "1"
    assert code == 0, gateway.log()
    assert "rolloutgate stopped" in gateway.log()
    assert took < 3.0 + 5.0 + 5.0, took  # grace (3 s real) + hand-back + exit
    add_figure(
        "shutdown.sigterm",
        {"finished": 3, "handed_back_503": 1, "exit_code": code, "seconds": round(took, 2)},
    )
    bump_figure("faults_survived.sigterm", 4)
