"""Trace capture (`--record-trace FILE`, server/trace.py): one line per finished request, no text, no ids."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.core.events import GateClosed, GateOpened, PauseMode
from rolloutgate.server.trace import FLUSH_BYTES, TRACE_VERSION, TraceRecorder
from rolloutreplay.trace_workload import read_trace
from rolloutsim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until

pytestmark = pytest.mark.looptime

SECRET = "the-prompt-text-that-must-not-be-traced"


def chat(session: str, max_tokens: int, user: str | None = "agent-7") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"{SECRET} " * 50}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    if user is not None:
        body["user"] = user
    return body


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def test_each_finished_request_is_one_line_with_its_lengths_outcome_and_timings_and_no_text(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    cluster = await make_cluster(engines=2, time_scale=50.0)
    gateway = await make_gateway(
        cluster, record_trace=str(trace), timeout=20.0, stall_timeout=60.0, keepalive_interval=0
    )
    url = f"{gateway.url}/v1/chat/completions"
    first = await http.post(url, json=chat("s1", 200), headers={"X-Session-Id": "s1"})
    second = await http.post(url, json=chat("s1", 300), headers={"X-Session-Id": "s1"})
    # ~55 s of decode at the default profile's ~90 tok/s: past the 20 s charged budget
    too_long = await http.post(url, json=chat("s2", 5_000, user=None), headers={"X-Session-Id": "s2"})
    assert [first.status_code, second.status_code, too_long.status_code] == [200, 200, 504]
    await gateway.stop()

    header, *requests = lines(trace)
    assert header["rolloutgate_trace"] == TRACE_VERSION
    assert header["clock"] == "engine" and header["settings"]["timeout"] == 20.0
    assert header["engines"] == cluster.urls
    assert [(r["session"], r["max_tokens"], r["outcome"]) for r in requests] == [
        ("s1", 200, "ok"),
        ("s1", 300, "ok"),
        ("s2", 5_000, "timeout"),
    ]
    ok = requests[0]
    assert ok["user"] == "agent-7" and requests[2]["user"] is None
    assert ok["id"] == first.headers["X-Rolloutgate-Request-Id"]
    assert ok["prompt_tokens"] == len(f"{SECRET} " * 50) // 4 + 1
    assert ok["output_tokens"] == 200 and ok["finish"] == "length" and ok["status"] == 200
    assert ok["cached_tokens"] == 0  # a first prompt: nothing of it in the engine's cache
    assert requests[1]["cached_tokens"] > 0  # the same prompt again: its prefix is cached
    assert 0 <= ok["at"] < ok["end"] <= requests[1]["at"]
    assert ok["timing"]["charged_s"] > 0 and ok["engine"] in cluster.urls
    assert requests[2]["status"] == 504 and requests[2]["timing"]["charged_s"] >= 20.0
    assert SECRET.encode() not in trace.read_bytes()
    assert len(read_trace(trace).requests) == 3  # what the replay reads


async def test_the_gateways_own_events_are_traced_a_quarantine_and_the_gate(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    cluster = await make_cluster(engines=2, time_scale=50.0)
    gateway = await make_gateway(
        cluster, record_trace=str(trace), stall_timeout=5.0, capacity=4, keepalive_interval=0
    )
    body = chat("s", 400)
    tasks = [
        asyncio.create_task(http.post(f"{gateway.url}/v1/chat/completions", json=body)) for _ in range(4)
    ]
    frozen = cluster.engines[0]
    await wait_until(lambda: frozen.running_count > 0, "a request started on the engine to freeze")
    frozen.set_fault(Fault(kind="freeze"))
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4
    assert (await http.post(f"{gateway.url}/admin/pause", json={})).status_code == 200
    assert (await http.post(f"{gateway.url}/admin/resume", json={})).status_code == 200
    await gateway.stop()

    events = read_trace(trace).events
    marks = [(e["engine"], e["state"]) for e in events if e["type"] == "engine"]
    assert (cluster.urls[0], "quarantined") in marks
    assert [e["state"] for e in events if e["type"] == "gate"] == ["closed", "open"]
    requests = read_trace(trace).requests
    assert len(requests) == 4 and all(r["outcome"] == "ok" for r in requests)
    assert any(r["attempts"] == 2 and r["engine"] == cluster.urls[1] for r in requests)


def test_lines_are_written_in_batches_and_all_of_them_on_close() -> None:
    sink = io.BytesIO()
    recorder = TraceRecorder(sink, lambda: 10.0, lambda _: None, {"clock": "engine"})
    recorder.observe(10.0, GateClosed(mode=PauseMode.DRAIN), [])
    assert sink.getvalue() == b""  # buffered
    while not sink.getvalue():
        recorder.observe(10.0, GateOpened(), [])
    assert FLUSH_BYTES <= len(sink.getvalue()) < FLUSH_BYTES + 100  # one batch, bounded
    written = recorder.lines
    recorder.observe(10.0, GateClosed(mode=PauseMode.DRAIN), [])
    data = sink.getvalue()
    sink.close = lambda: None  # type: ignore[method-assign]  # keep the buffer readable after close
    recorder.close()
    assert len(sink.getvalue()) > len(data)
    assert sink.getvalue().count(b"\n") == written + 1 == recorder.lines


def test_a_trace_that_cannot_be_written_stops_tracing_and_the_gateway_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Full(io.BytesIO):
        def write(self, data: Any) -> int:
            raise OSError(28, "No space left on device")

    recorder = TraceRecorder(Full(), lambda: 0.0, lambda _: None, {})
    while "cannot write the trace" not in caplog.text:
        recorder.observe(0.0, GateOpened(), [])  # the batch's write fails: logged, not raised
    stopped_at = recorder.lines
    recorder.observe(0.0, GateOpened(), [])
    recorder.close()
    assert recorder.lines == stopped_at  # nothing more is buffered: memory stays bounded
