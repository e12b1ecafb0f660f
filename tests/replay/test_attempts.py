"""What the replay records without touching the gateway: the client's attempts (rolloutreplay/attempts.py), the
gateway's arrivals, verdicts and engine marks through the driver's observers (rolloutreplay/gateway.py), and
the join of the two."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from rolloutgate.config import EngineSpec, GatewaySettings
from rolloutgate.core.commands import MarkEngine
from rolloutgate.server.app import GatewayServer
from rolloutreplay.attempts import AttemptRecord, AttemptTap, join, recording
from rolloutreplay.gateway import GatewayRecorder
from rolloutsim import SimCluster


def _attempt(key: str, sent: float, request_id: str | None = None) -> AttemptRecord:
    return AttemptRecord(
        tag=f"{key}-t",
        routing_key=key,
        retry_count=0,
        arrived_at=sent,
        path="/v1/chat/completions",
        request_id=request_id,
    )


def test_an_arrival_belongs_to_the_last_attempt_of_its_session_sent_before_it() -> None:
    first, retry, other = _attempt("s1", 10.0), _attempt("s1", 40.0), _attempt("s2", 11.0)
    attached = _attempt("s1", 70.0, request_id="r1")  # a retry that attached: its answer named r1
    join([retry, attached, first, other], [(10.2, "r1", "s1"), (11.1, "r2", "s2"), (40.3, "r3", "s1")])
    assert [first.request_id, retry.request_id, attached.request_id, other.request_id] == [
        "r1",
        "r3",
        "r1",
        "r2",
    ]
    stray = _attempt("s3", 5.0)
    join([stray], [(4.0, "r9", "s3"), (6.0, "r10", None)])  # before any attempt; no routing key
    assert stray.request_id is None


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


class _Broken(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"{"
        raise httpx.ReadTimeout("the client's read timeout")


def _engine(request: httpx.Request) -> httpx.Response:
    headers = {"X-Rolloutgate-Request-Id": "r7", "Content-Type": "application/json"}
    if request.url.path == "/broken":
        return httpx.Response(200, headers=headers, stream=_Broken())
    return httpx.Response(200, headers=headers, content=b'{"ok": true}')


async def test_the_tap_records_each_attempt_made_within_a_turn() -> None:
    attempts: list[AttemptRecord] = []
    clock = _Clock()
    async with httpx.AsyncClient(transport=AttemptTap(httpx.MockTransport(_engine))) as client:
        await client.post("http://gw/v1/chat/completions", json={})  # no turn: not recorded
        assert attempts == []
        with recording("s1-t0", "s1", clock, attempts):
            answer = await client.post(
                "http://gw/v1/chat/completions", json={}, headers={"x-stainless-retry-count": "1"}
            )
            assert answer.json() == {"ok": True}
            with pytest.raises(httpx.ReadTimeout):
                await client.post("http://gw/broken", json={})
    done, cut = attempts
    assert (done.tag, done.routing_key, done.retry_count, done.request_id) == ("s1-t0", "s1", 1, "r7")
    assert (done.status, done.client_gone) == (200, False) and done.ended_at is not None
    assert done.arrived_at < done.ended_at
    assert cut.client_gone and cut.status == 200 and cut.path == "/broken"


async def test_the_recorder_sees_the_production_gateway_through_its_driver() -> None:
    async with SimCluster(engines=1, api="sglang", profile="fast") as cluster:
        settings = GatewaySettings(
            host="127.0.0.1", port=0, engines=[EngineSpec(url=cluster.urls[0], family="sglang")]
        )
        server = GatewayServer(settings)
        await server.start()
        try:
            recorder = GatewayRecorder(server.context, cluster.clock.now)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with httpx.AsyncClient() as client:
                answer = await client.post(
                    f"{server.url}/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"}
                )
            assert answer.status_code == 200
            request_id = answer.headers["X-Rolloutgate-Request-Id"]
            assert [(rid, key) for _, rid, key in recorder.arrivals] == [(request_id, "s1")]
            end = recorder.ends[request_id]
            assert end.ok and end.code == "ok" and end.engine_url == cluster.urls[0] and end.timing
            engine_id = next(iter(server.context.pool.engines))
            observer = server.context.driver.observers[0]
            observer(0.0, None, [MarkEngine(engine_id=engine_id, state="quarantined", detail="test")])
            assert [(m.engine_url, m.state) for m in recorder.marks] == [(cluster.urls[0], "quarantined")]
        finally:
            await server.stop()
