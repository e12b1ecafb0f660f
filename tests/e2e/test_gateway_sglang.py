"""Through the gateway, on SGLang: TITO `/generate` with logprobs, a trainer's pause of each mode driven on the
engine itself while a call runs through the gateway, the rollout's engine control (`/abort_request` by rid and
`abort_all`, `/flush_cache`) through the gateway. Each check of what an engine did reads the engine."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tests.e2e.conftest import MakeGateway
from tests.e2e.harness import EngineSet, pause_engine, resume_engine, scrape, scrape_all, settled, wait_for
from tests.e2e.sglang_facts import facts_for
from tests.server.users_path import final_timing, metric_sum

pytestmark = [pytest.mark.e2e, pytest.mark.api("sglang")]

PROMPT_IDS = [10, 20, 30, 40, 50]  # inside the tiny model's vocabulary (2,048 ids)
LONG = 7000  # ~25 s alone on real 0.5.9 here: outlasts what a test waits for, and is aborted
TOKENS = 600  # a few seconds
PAUSED_CALL_TOKENS = 3_000  # ~11 s alone on real 0.5.9 here
PAUSE_S = 3.0


def generate_body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        **extra,
    }


async def stream_generate(
    url: str, body: dict[str, Any], started: asyncio.Event
) -> tuple[int, list[dict[str, Any]], bool, dict[str, str]]:
    """A streamed `/generate` through `url`: (status, data chunks, ended with [DONE], headers); `started` is
    set at the first chunk."""
    chunks: list[dict[str, Any]] = []
    done = False
    async with (
        httpx.AsyncClient(timeout=300.0) as client,
        client.stream("POST", url + "/generate", json={**body, "stream": True}) as response,
    ):
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(orjson.loads(line[len("data: ") :]))
                started.set()
    return response.status_code, chunks, done, {k.lower(): v for k, v in response.headers.items()}


def check_tito(answer: dict[str, Any], max_new_tokens: int) -> None:
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": max_new_tokens}
    assert len(answer["output_ids"]) == meta["completion_tokens"] == max_new_tokens
    assert [entry[1] for entry in meta["output_token_logprobs"]] == answer["output_ids"]
    assert all(isinstance(entry[0], float) for entry in meta["output_token_logprobs"])


async def test_tito_generate_with_logprobs_whole(engines: EngineSet, gateways: MakeGateway) -> None:
    gateway = gateways()
    before = await scrape_all(engines.urls)
    async with httpx.AsyncClient(timeout=120.0) as client:
        response = await client.post(gateway.url + "/generate", json=generate_body(48))
    assert response.status_code == 200, response.text
    answer = response.json()
    check_tito(answer, 48)
    engine = response.headers["x-rolloutgate-engine"]
    assert engine in engines.urls
    after = await scrape_all(engines.urls)
    assert after[engine].generated - before[engine].generated == 48, "the engine named did not generate it"


async def test_tito_generate_with_logprobs_streamed(engines: EngineSet, gateways: MakeGateway) -> None:
    gateway = gateways()
    status, chunks, done, headers = await stream_generate(gateway.url, generate_body(32), asyncio.Event())
    assert status == 200 and done
    assert headers["x-rolloutgate-engine"] in engines.urls
    check_tito(chunks[-1], 32)
    ids = [c["output_ids"] for c in chunks]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))


async def running_call(
    gateway_url: str, max_new_tokens: int, *, stream: bool, **extra: Any
) -> asyncio.Task[Any]:
    """A TITO call through the gateway, returned once an engine runs it (a streamed call: its first chunk; a
    whole one: `busy_engine` finds it)."""
    body = generate_body(max_new_tokens, **extra)
    if stream:
        started = asyncio.Event()
        task: asyncio.Task[Any] = asyncio.create_task(stream_generate(gateway_url, body, started))
        await asyncio.wait_for(started.wait(), 60.0)
        return task

    async def whole() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300.0) as client:
            return await client.post(gateway_url + "/generate", json=body)

    return asyncio.create_task(whole())


def answer_of(result: Any, stream: bool) -> dict[str, Any]:
    """The final answer of a `running_call`: the last chunk of a stream that ended with [DONE], or the body."""
    if stream:
        status, chunks, done, _ = result
        assert status == 200 and done
        return dict(chunks[-1])
    assert result.status_code == 200, result.text
    return dict(result.json())


async def busy_engine(engines: EngineSet) -> str:
    """The engine running a call now (the only call of the test)."""
    found = await wait_for(
        "a call running on an engine",
        lambda: scrape_all(engines.urls),
        lambda ms: any(m.running > 0 and m.progress > 0 for m in ms.values()),
        30.0,
    )
    return next(url for url, m in found.items() if m.running > 0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_engine_paused_directly_holds_the_gateway_call_until_continue(
    engines: EngineSet, gateways: MakeGateway, mode: str, stream: bool
) -> None:
    """A trainer pauses the engine itself (retract or in_place) while a logprob call runs through the gateway:
    the engine generates nothing during the pause, the call is held, and after continue it gets its whole
    answer: one retraction for retract, none for in_place."""
    facts = facts_for(engines.version)
    gateway = gateways()
    task = await running_call(gateway.url, TOKENS * 4, stream=stream)
    url = await busy_engine(engines)
    async with httpx.AsyncClient(timeout=60.0) as trainer:
        assert (await pause_engine(trainer, engines, url, mode)).status_code == 200
        paused_at = time.monotonic()
        try:
            first = (await settled([url]))[url]  # the decode step in flight lands after the pause answered
            await asyncio.sleep(PAUSE_S)
            second = await scrape(url)
            assert second.progress == first.progress, "the engine generated while paused"
            assert not task.done(), "the call ended during the pause"
        finally:
            await resume_engine(trainer, engines, url)
        paused_s = time.monotonic() - paused_at
    answer = answer_of(await asyncio.wait_for(task, 120.0), stream)
    check_tito(answer, TOKENS * 4)
    assert answer["meta_info"][facts.retractions_key] == (1 if mode == "retract" else 0)
    print(f"{mode}: paused {paused_s:.1f} s; meta_info {answer['meta_info'].get('e2e_latency')}")


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("mode", "pause_s"), [("in_place", 30.0), ("retract", 120.0)])
async def test_a_pause_driven_on_the_engine_is_not_charged(
    engines: EngineSet, gateways: MakeGateway, mode: str, pause_s: float
) -> None:
    """Issue 32's goal on the real engine: a 3,000-token logprob call answered whole (progress only in the
    engine's token counter, read every 3 s at the default stall timeout) is paused on the engine for 30 s in
    place or 120 s by retraction, nobody telling the gateway (0.5.9 has no `/ready`: the gateway sees the
    pause in its hanging `/health`). Charged: within 1 s of the engine's own work on the call (SGLang's
    `e2e_latency` less the pause); no engine quarantined."""
    gateway = gateways()
    task = await running_call(gateway.url, PAUSED_CALL_TOKENS, stream=False)
    url = await busy_engine(engines)
    async with httpx.AsyncClient(timeout=60.0) as trainer:
        assert (await pause_engine(trainer, engines, url, mode)).status_code == 200
        paused_at = time.monotonic()
        try:
            await asyncio.sleep(pause_s)
        finally:
            await resume_engine(trainer, engines, url)
        paused_s = time.monotonic() - paused_at
        response = await asyncio.wait_for(task, 300.0)
        metrics = (await trainer.get(gateway.url + "/metrics")).text
    answer = answer_of(response, False)
    check_tito(answer, PAUSED_CALL_TOKENS)
    timing = final_timing(response)  # in the body: keep-alive sent the headers long before
    engine_work_s = answer["meta_info"]["e2e_latency"] - paused_s
    print(f"{mode} {pause_s:.0f} s: engine work {engine_work_s:.2f} s, gateway {timing}")
    assert abs(timing["charged"] - engine_work_s) <= 1.0, (engine_work_s, paused_s, timing)
    assert metric_sum(metrics, "rolloutgate_engine_quarantines_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_engine_paused_directly_in_abort_mode_ends_the_gateway_call_as_sglang_does(
    engines: EngineSet, gateways: MakeGateway, stream: bool
) -> None:
    """A trainer's `/pause_generation {"mode": "abort"}` on the engine ends the running call; the gateway
    hands the client SGLang's own answer (200, finish reason abort, the tokens and logprobs so far), as a
    rollout framework expects from SGLang, and sends the call nowhere else."""
    gateway = gateways()
    before = await scrape_all(engines.urls)
    task = await running_call(gateway.url, LONG, stream=stream)
    url = await busy_engine(engines)
    async with httpx.AsyncClient(timeout=60.0) as trainer:
        try:
            assert (await pause_engine(trainer, engines, url, "abort")).status_code == 200
            result = await asyncio.wait_for(task, 30.0)
        finally:
            await resume_engine(trainer, engines, url)
    answer = answer_of(result, stream)
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < LONG
    assert len(meta["output_token_logprobs"]) == len(answer["output_ids"]) == meta["completion_tokens"]
    after = await scrape_all(engines.urls)
    others = [u for u in engines.urls if u != url]
    assert all(after[u].generated == before[u].generated for u in others), "the call went on elsewhere"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_abort_by_rid_through_the_gateway(
    engines: EngineSet, gateways: MakeGateway, stream: bool
) -> None:
    """miles' `/abort_request {"rid"}` with its own rid, sent to the gateway: the running call ends with
    SGLang's abort answer and the engine stops."""
    gateway = gateways()
    rid = f"e2e-{uuid.uuid4().hex[:12]}"
    task = await running_call(gateway.url, LONG, stream=stream, rid=rid)
    url = await busy_engine(engines)
    async with httpx.AsyncClient(timeout=30.0) as client:
        aborted = await client.post(gateway.url + "/abort_request", json={"rid": rid})
    assert aborted.status_code == 200, aborted.text
    answer = answer_of(await asyncio.wait_for(task, 30.0), stream)
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < answer["meta_info"]["completion_tokens"] < LONG
    await wait_for("the engine idle", lambda: scrape(url), lambda m: m.running == 0, 15.0)


def started_count(events: list[asyncio.Event]) -> Callable[[], Awaitable[int]]:
    async def count() -> int:
        return sum(event.is_set() for event in events)

    return count


async def test_abort_all_through_the_gateway_ends_every_call(
    engines: EngineSet, gateways: MakeGateway
) -> None:
    """The end of a rollout step (miles): `abort_all` to the gateway ends the calls running on every engine
    and those still waiting in the gateway, each with SGLang's abort answer."""
    gateway = gateways()
    slots = len(engines.urls) * engines.max_num_seqs
    events = [asyncio.Event() for _ in range(slots + 2)]  # two more than fit: they wait in the gateway
    tasks = [asyncio.create_task(stream_generate(gateway.url, generate_body(LONG), e)) for e in events]
    # Any `slots` of them: the calls reach the gateway in no set order, so which two wait is not known.
    await wait_for("the engines full", started_count(events), lambda n: n >= slots, 60.0)
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=30.0) as client:
        aborted = await client.post(gateway.url + "/abort_request", json={"abort_all": True})
    assert aborted.status_code == 200, aborted.text
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
    for status, chunks, done, _ in results:
        assert status == 200 and done
        meta = chunks[-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < LONG
    ran = [r for r in results if r[1][-1]["meta_info"]["completion_tokens"] > 0]
    assert len(ran) >= slots, "fewer calls ran than the engines hold"
    await wait_for(
        "every engine idle",
        lambda: scrape_all(engines.urls),
        lambda ms: all(m.running == 0 and m.waiting == 0 for m in ms.values()),
        15.0,
    )


async def test_flush_cache_through_the_gateway(engines: EngineSet, gateways: MakeGateway) -> None:
    gateway = gateways()
    async with httpx.AsyncClient(timeout=60.0) as client:
        response = await client.post(gateway.url + "/flush_cache")
    assert response.status_code == 200, response.text
    assert response.text.startswith("Cache flushed.")


async def engine_vocabulary(url: str) -> int:
    """The vocabulary of the engine's model: the simulator states it in `/server_info`; a real SGLang names its
    model folder there (`model_path`), whose config.json has it."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        info = (await client.get(url + "/server_info")).json()
    if isinstance(info.get("vocab_size"), int):
        return int(info["vocab_size"])
    return int(orjson.loads((Path(info["model_path"]) / "config.json").read_bytes())["vocab_size"])


@pytest.mark.parametrize("which", ["far", "first-past", "negative"])
async def test_out_of_vocabulary_id_is_a_400_and_the_engine_serves_the_next_call(
    engines: EngineSet, gateways: MakeGateway, which: str
) -> None:
    """An id past the vocabulary (the tiny model's 2,048 ids) or a negative one kills a real SGLang 0.5.9
    (IndexError in its scheduler's embedding, the server exits). Through the gateway: a 400 naming the id and
    its place, the engines sent nothing, and they serve the next call."""
    vocabulary = await engine_vocabulary(engines.urls[0])
    bad = {"far": 999_999_999, "first-past": vocabulary, "negative": -1}[which]
    code = "invalid_token_id" if bad < 0 else "token_id_out_of_vocabulary"
    gateway = gateways()
    before = await scrape_all(engines.urls)
    async with httpx.AsyncClient(timeout=60.0) as client:
        body = generate_body(8)
        body["input_ids"] = [*PROMPT_IDS, bad]
        refused = await client.post(gateway.url + "/generate", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == code
        assert f"input_ids[{len(PROMPT_IDS)}]" in error["message"] and str(bad) in error["message"]
        after = await scrape_all(engines.urls)  # health checks are not counted (0.5.9 and the simulator)
        for url in engines.urls:
            requests = "sglang:num_requests_total"
            assert after[url].value(requests) == before[url].value(requests), f"{url} was sent the call"
            assert (await client.get(url + "/health", timeout=30.0)).status_code == 200, f"{url} is down"
        served = await client.post(gateway.url + "/generate", json=generate_body(8))
    assert served.status_code == 200, served.text
    check_tito(served.json(), 8)
