"""The engine's output path (SGLang's tokenizer manager): its queue arithmetic, its counters, and what a
saturated one does to the other answers of its engine, all in simulated time."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Any

import aiohttp
import orjson
import pytest

from rolloutgate.cli import build_parser
from rolloutsim import EngineModel, SimRequest, make_config
from rolloutsim.http_common import DONE
from rolloutsim.output_path import OutputPath, token_ready_at

from .conftest import ClusterFactory
from .helpers import wait_until

SCALE = 50.0
OUTPUT_METRICS = ("sim:output_bytes_total", "sim:output_chunks_total", "sim:output_busy_seconds_total")


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Metric name (labels dropped) -> value, for the unlabelled-by-reason series."""
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            out.setdefault(name_labels.split("{", 1)[0], float(value))
    return out


async def post_raw(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    async with session.post(url, json=body) as response:
        assert response.status == 200
        return await response.read()


def cost_s(chunks: float, nbytes: float, *, chunk_s: float = 30e-6, rate: float = 200e6) -> float:
    return chunks * chunk_s + nbytes / rate


# --------------------------------------------------------------------------------- sans-IO


def test_output_path_is_a_fifo_single_server() -> None:
    path = OutputPath(make_config("default", output_bytes_per_s=1000.0, output_chunk_s=0.01))
    assert path.enabled
    assert path.book(1.0, 90) == pytest.approx((1.0, 1.1))  # 10 ms + 90 bytes at 1,000 B/s
    start, done = path.book(1.05, 190)  # ready while the first is served: waits for it
    assert (start, done) == pytest.approx((1.1, 1.3))
    assert path.backlog_s(1.2) == pytest.approx(0.1)
    assert path.busy_s(1.2) == pytest.approx(0.2)  # the work booked past t=1.2 is not counted yet
    assert path.book(2.0, 0) == pytest.approx((2.0, 2.01))  # the queue was idle: no wait
    assert path.busy_s(5.0) == pytest.approx(0.31)
    path.book(3.0, 1000)  # busy until 4.01
    path.reset(3.5)  # a crash loses what was left
    assert path.backlog_s(3.5) == 0.0 and path.busy_s(10.0) == pytest.approx(0.31 + 0.5)
    free = OutputPath(make_config("fast"))
    assert not free.enabled and free.cost_s(10**9) == 0.0


def test_default_figures_and_validation() -> None:
    for profile in ("default", "incident"):
        config = make_config(profile)
        assert (config.output_bytes_per_s, config.output_chunk_s) == (200e6, 30e-6)
        assert config.output_cost_enabled
    assert not make_config("fast").output_cost_enabled
    with pytest.raises(ValueError, match="output_bytes_per_s"):
        make_config("default", output_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="output_chunk_s"):
        make_config("default", output_chunk_s=-1.0)


def test_cli_flags_set_the_budget() -> None:
    from rolloutsim.cli import _overrides

    parser = build_parser(only="sim")
    args = parser.parse_args(["sim", "--output-mb-per-s", "50", "--output-chunk-us", "20"])
    assert _overrides(args) == {"output_bytes_per_s": 50e6, "output_chunk_s": pytest.approx(20e-6)}
    args = parser.parse_args(["sim", "--no-output-cost"])
    assert _overrides(args) == {"output_bytes_per_s": math.inf, "output_chunk_s": 0.0}


def test_emission_log_gives_each_streamed_token_its_time() -> None:
    model = EngineModel(make_config("default", record_token_times=True))
    req = SimRequest("s", [1, 2, 3], max_new_tokens=40)
    req.emit_log = deque()
    other = SimRequest("o", [4, 5, 6], max_new_tokens=10)
    model.submit(req, 0.0)
    model.submit(other, 0.0)
    model.advance(0.05)
    model.advance(0.3)  # a burst of decode steps, then the rest
    model.advance(5.0)
    assert req.token_times is not None and len(req.token_times) == 40
    assert [token_ready_at(req, k) for k in range(1, 41)] == req.token_times
    assert token_ready_at(other, 1) is None  # not streamed: not logged


# --------------------------------------------------------------------------------- counters over HTTP


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_a_non_streamed_answer_is_one_chunk_of_its_body(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, api: str
) -> None:
    cluster = await make_cluster(api=api, time_scale=SCALE)
    url = cluster.urls[0]
    before = await metrics(session, url)
    assert all(before[name] == 0 for name in OUTPUT_METRICS)
    if api == "sglang":
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64}, "return_logprob": True}
        raw = await post_raw(session, url + "/generate", body)
        assert len(orjson.loads(raw)["meta_info"]["output_token_logprobs"]) == 64
    else:
        body = {"model": "sim-model", "prompt": [5, 6, 7], "max_tokens": 64, "logprobs": 1}
        raw = await post_raw(session, url + "/v1/completions", body)
    after = await metrics(session, url)
    assert after["sim:output_chunks_total"] == 1
    assert after["sim:output_bytes_total"] == len(raw)
    assert after["sim:output_busy_seconds_total"] == pytest.approx(cost_s(1, len(raw)))
    assert after[f"{api}:generation_tokens_total"] == 64
    state = cluster.engines[0].state()
    assert state["output_chunks_total"] == 1 and state["output_bytes_total"] == len(raw)
    assert state["output_backlog_s"] == 0.0


async def test_a_cumulative_stream_costs_a_chunk_per_token_and_quadratic_bytes(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url = cluster.urls[0]
    sizes = {}
    for n in (50, 100):
        before = await metrics(session, url)
        body = {
            "input_ids": [9, 8, n],
            "sampling_params": {"max_new_tokens": n, "stream_interval": 1},
            "return_logprob": True,
            "stream": True,
        }
        raw = await post_raw(session, url + "/generate", body)
        after = await metrics(session, url)
        assert raw.endswith(DONE) and raw.count(b"data: ") == n + 1  # one cumulative chunk per token
        chunks = after["sim:output_chunks_total"] - before["sim:output_chunks_total"]
        nbytes = after["sim:output_bytes_total"] - before["sim:output_bytes_total"]
        assert chunks == n
        assert nbytes == len(raw) - len(DONE)
        busy = after["sim:output_busy_seconds_total"] - before["sim:output_busy_seconds_total"]
        assert busy == pytest.approx(cost_s(n, nbytes))
        sizes[n] = nbytes
    assert (
        sizes[100] > 3.3 * sizes[50]
    )  # twice the tokens, ~4x the bytes (the fixed part of each chunk aside)
    # the same answer at stream_interval 10: a tenth of the chunks, ~a tenth of the bytes
    before = await metrics(session, url)
    body = {
        "input_ids": [9, 8, 100],
        "sampling_params": {"max_new_tokens": 100, "stream_interval": 10},
        "return_logprob": True,
        "stream": True,
    }
    raw = await post_raw(session, url + "/generate", body)
    after = await metrics(session, url)
    assert after["sim:output_chunks_total"] - before["sim:output_chunks_total"] == 11  # first token, 10..100
    assert after["sim:output_bytes_total"] - before["sim:output_bytes_total"] == len(raw) - len(DONE)


async def test_openai_streams_count_every_data_chunk(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url = cluster.urls[0]
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    raw = await post_raw(session, url + "/v1/chat/completions", body)
    after = await metrics(session, url)
    assert after["sim:output_chunks_total"] == 1 + 20 + 1  # role, one delta per token, usage
    assert after["sim:output_bytes_total"] == len(raw) - len(DONE)
    assert after["vllm:generation_tokens_total"] == 20


async def test_loads_snapshot_has_a_timestamp(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    async with session.get(cluster.urls[0] + "/v1/loads") as response:
        loads = await response.json()
    assert isinstance(loads["timestamp"], float) and loads["loads"][0]["dp_rank"] == 0


# --------------------------------------------------------------------------------- saturation


async def _flood_and_probe(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, *, stream: bool
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """8 requests of 100 tokens with logprobs (cumulative interval-1 streams, or not streamed) and a
    non-streamed 20-token probe, all started in the same step (held back by the blackhole fault until all
    are queued, so host speed does not matter), on one engine whose output path serialises 100 KB per
    simulated second. Returns the probe's body, the engine's /sim/state afterwards, and /health's status
    while the flood's answers are still queued."""
    cluster = await make_cluster(time_scale=SCALE, max_running_requests=16, output_bytes_per_s=100e3)
    engine, url = cluster.engines[0], cluster.urls[0]

    async def one(i: int, tokens: int, streamed: bool) -> bytes:
        body = {
            "input_ids": [100 + i, 7, 8],
            "rid": f"r{i}",
            "sampling_params": {"max_new_tokens": tokens, "stream_interval": 1},
            "return_logprob": True,
            "stream": streamed,
        }
        return await post_raw(session, url + "/generate", body)

    engine.set_fault("blackhole")
    flood = [asyncio.create_task(one(i, 100, stream)) for i in range(8)]
    probe_task = asyncio.create_task(one(99, 20, False))
    await wait_until(lambda: engine.waiting_count == 9)
    engine.clear_faults()
    probe = orjson.loads(await probe_task)
    async with session.get(url + "/health") as response:
        health = response.status
    await asyncio.gather(*flood)
    state = engine.state()
    assert len({state["requests"][f"r{i}"]["started_at"] for i in (*range(8), 99)}) == 1  # one batch
    return probe, state, health


async def test_a_flood_of_cumulative_streams_delays_the_engines_other_answers(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    probe, state, health = await _flood_and_probe(make_cluster, session, stream=True)
    record = state["requests"]["r99"]
    physics = record["finished_at"] - record["submitted_at"]
    # the probe's body waited behind the streams' chunks: e2e_latency (stamped when the tokenizer manager gets
    # to the finished output, as SGLang does) and answered_at show it, in simulated time
    # (by the probe's last token, 8 streams x 20 cumulative chunks, ~100 KB, need ~1.0 s of the output path,
    # 0.38 s of decoding has passed; the figure is the same on every run, however busy the host)
    delay = probe["meta_info"]["e2e_latency"] - physics
    assert 0.5 < delay < 0.8
    assert record["answered_at"] - record["finished_at"] > delay
    flood = [state["requests"][f"r{i}"] for i in range(8)]
    assert all(r["answered_at"] - r["finished_at"] > 1.0 for r in flood)  # the streams themselves end late
    assert state["output_chunks_total"] == 8 * 100 + 1
    assert state["output_busy_s"] == pytest.approx(
        cost_s(state["output_chunks_total"], state["output_bytes_total"], rate=100e3), rel=1e-3
    )
    assert health == 200  # /health does not go through the output path


async def test_the_same_load_not_streamed_does_not_delay_them(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    probe, state, health = await _flood_and_probe(make_cluster, session, stream=False)
    record = state["requests"]["r99"]
    physics = record["finished_at"] - record["submitted_at"]
    assert probe["meta_info"]["e2e_latency"] == pytest.approx(
        physics, abs=1e-9
    )  # served the moment it was ready
    own = cost_s(1, len(orjson.dumps(probe)), rate=100e3)
    assert record["answered_at"] - record["finished_at"] == pytest.approx(own, rel=1e-3)  # its own body only
    assert state["output_chunks_total"] == 9
    assert health == 200


async def test_a_backed_up_stream_keeps_its_chunks_as_recipes_past_its_budget(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks waiting for the output path beyond STREAM_QUEUE_BYTES are rebuilt when due: the same bytes."""
    from rolloutsim import http_common

    monkeypatch.setattr(http_common, "STREAM_QUEUE_BYTES", 4096)
    body = {
        "input_ids": [3, 1, 4],
        "rid": "same",
        "sampling_params": {"max_new_tokens": 60},
        "return_logprob": True,
        "stream": True,
    }
    slow = await make_cluster(time_scale=SCALE, output_bytes_per_s=20e3)  # ~76 KB of chunks: ~3.8 s
    free = await make_cluster(time_scale=SCALE, output_bytes_per_s=math.inf, output_chunk_s=0.0)
    held = await post_raw(session, slow.urls[0] + "/generate", body)
    plain = await post_raw(session, free.urls[0] + "/generate", body)
    record = slow.engines[0].state(rid="same")["request"]
    assert record["answered_at"] - record["finished_at"] > 2.0  # the chunks really waited
    held_chunks, plain_chunks = held.split(b"\n\n"), plain.split(b"\n\n")
    assert len(held_chunks) == len(plain_chunks) == 60 + 2  # 60 chunks, [DONE], the empty tail
    assert held_chunks[:-3] == plain_chunks[:-3]  # all but the final chunk (its e2e_latency differs)
    assert (await metrics(session, slow.urls[0]))["sim:output_bytes_total"] == len(held) - len(DONE)


async def test_vllm_streams_load_the_output_path_too(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """vLLM's chunks are deltas (linear, not quadratic), but they still pass through the engine's one output
    process: with a tight budget, 8 streams hold back a non-streamed answer that finishes among them."""
    cluster = await make_cluster(
        api="vllm", time_scale=SCALE, max_running_requests=16, output_bytes_per_s=20e3
    )
    engine, url = cluster.engines[0], cluster.urls[0]

    def body(i: int, tokens: int, stream: bool) -> dict[str, Any]:
        return {
            "model": "sim-model",
            "prompt": [100 + i, 7, 8],
            "max_tokens": tokens,
            "logprobs": 1,
            "stream": stream,
        }

    async def one(i: int, tokens: int, stream: bool) -> bytes:
        async with session.post(
            url + "/v1/completions", json=body(i, tokens, stream), headers={"X-Request-Id": f"v{i}"}
        ) as response:
            assert response.status == 200
            return await response.read()

    engine.set_fault("blackhole")
    flood = [asyncio.create_task(one(i, 100, True)) for i in range(8)]
    probe = asyncio.create_task(one(99, 20, False))
    await wait_until(lambda: engine.waiting_count == 9)
    engine.clear_faults()
    await asyncio.gather(probe, *flood)
    record = engine.state(rid="v99")["request"]
    assert record["answered_at"] - record["finished_at"] > 0.5
    chunks = (await metrics(session, url))["sim:output_chunks_total"]
    assert chunks == 8 * 100 + 1
