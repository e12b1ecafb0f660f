"""Client protection (issue 4): keep-alive, retries that attach, errors after keep-alive, disconnects.

Time-scaled: the simulator and the gateway run at SCALE, the clients' timeouts are the loop's seconds; on a
fake-time loop (looptime), so every wait here (keep-alive, client timeouts, grace periods) costs no real time.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import litellm
import openai
import pytest

from rolloutsim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway
from tests.sim.helpers import wait_until

SCALE = 50.0
CLIENT_TIMEOUT_S = 1.0  # loop seconds (SCALE simulated seconds)
MESSAGES = [{"role": "user", "content": "hello there"}]


def chat(max_tokens: int, **extra: object) -> dict[str, object]:
    return {"model": "sim-model", "messages": MESSAGES, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def requests_total(cluster: object, index: int) -> int:
    return int(cluster.engines[index].state(include_requests=False)["requests_total"])  # type: ignore[attr-defined]


async def start_blocker(http: httpx.AsyncClient, url: str, loop_s: float) -> asyncio.Task[httpx.Response]:
    """A request that holds the only slot for about `loop_s` loop seconds (default profile ~90 tok/s)."""
    tokens = int(loop_s * SCALE * 90)
    return asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=chat(tokens), timeout=60))


# --- keep-alive --------------------------------------------------------------------------------------------


@pytest.mark.looptime
@pytest.mark.parametrize("client", ["httpx", "openai", "litellm"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.looptime
async def test_a_request_waiting_4x_the_client_timeout_completes_with_one_generation(
    make_cluster: MakeCluster, make_gateway: MakeGateway, client: str, stream: bool
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, capacity=1)
    async with httpx.AsyncClient() as http:
        blocker = await start_blocker(http, gateway.url, 4 * CLIENT_TIMEOUT_S + 0.5)
        await wait_until(lambda: cluster.engines[0].running_count == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        text = await _ask(client, gateway.url, stream)
        waited = loop.time() - started
        assert (await blocker).status_code == 200
    assert text
    assert waited > 4 * CLIENT_TIMEOUT_S  # it really waited past the client's timeout, four times over
    assert requests_total(cluster, 0) == 2  # the blocker and exactly one generation for this request


async def _ask(client: str, url: str, stream: bool) -> str:
    body = chat(5, stream=stream)
    if client == "httpx":
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
            if not stream:
                response = await http.post(f"{url}/v1/chat/completions", json=body)
                return str(response.json()["choices"][0]["message"]["content"])
            text = ""
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        delta = json.loads(line[6:])["choices"][0]["delta"]
                        text += delta.get("content") or ""
            return text
    if client == "openai":
        sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=CLIENT_TIMEOUT_S)
        try:
            if not stream:
                reply = await sdk.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=5)
                return reply.choices[0].message.content or ""
            chunks = await sdk.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=5, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        finally:
            await sdk.close()
    response = await litellm.acompletion(
        model="openai/sim-model",
        api_base=f"{url}/v1",
        api_key="x",
        messages=MESSAGES,
        max_tokens=5,
        timeout=CLIENT_TIMEOUT_S,
        num_retries=3,
        stream=stream,
    )
    if not stream:
        return str(response.choices[0].message.content)
    return "".join([chunk.choices[0].delta.content or "" async for chunk in response])


# --- the 901 s pattern ---------------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_the_901s_pattern_becomes_one_generation_and_one_answer_from_another_engine(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    """LiteLLM (timeout T, 3 attempts) against a frozen engine: the client is kept alive instead of retrying
    onto the frozen engine; after stall_timeout the gateway moves the request to the healthy engine."""
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    cluster.engines[0].set_fault(Fault(kind="freeze"))
    stall_timeout_sim = 3 * CLIENT_TIMEOUT_S * SCALE  # three client timeouts: the incident's 901 s
    gateway = await make_gateway(cluster, stall_timeout=stall_timeout_sim)
    response = await litellm.acompletion(
        model="openai/sim-model",
        api_base=f"{gateway.url}/v1",
        api_key="x",
        messages=MESSAGES,
        max_tokens=5,
        timeout=CLIENT_TIMEOUT_S,
    )
    assert response.choices[0].message.content
    assert requests_total(cluster, 0) == 1  # one generation on the frozen engine, not three
    assert requests_total(cluster, 1) == 1  # and one on the engine that answered


# --- attach -------------------------------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_two_samples_of_one_prompt_in_different_sessions_are_two_generations(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    async with httpx.AsyncClient(timeout=30) as http:
        answers = await asyncio.gather(
            *(
                http.post(f"{gateway.url}/v1/chat/completions", json=chat(20), headers={"X-Session-Id": s})
                for s in ("session-a", "session-b")
            )
        )
        no_session = await asyncio.gather(
            *(http.post(f"{gateway.url}/v1/chat/completions", json=chat(20)) for _ in range(2))
        )
    assert [r.status_code for r in (*answers, *no_session)] == [200] * 4
    assert requests_total(cluster, 0) == 4


@pytest.mark.looptime
async def test_a_retry_with_the_same_key_attaches_in_flight_and_after_the_end(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster)
    headers = {"Idempotency-Key": "rollout-17-turn-3"}
    async with httpx.AsyncClient(timeout=30) as http:
        first, second = await asyncio.gather(
            http.post(f"{gateway.url}/v1/chat/completions", json=chat(200), headers=headers),
            http.post(f"{gateway.url}/v1/chat/completions", json=chat(200), headers=headers),
        )
        later = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(200), headers=headers)
        same_session = [
            await http.post(
                f"{gateway.url}/v1/chat/completions", json=chat(30), headers={"X-Session-Id": "s1"}
            )
            for _ in range(2)
        ]
    assert first.json()["choices"] == second.json()["choices"] == later.json()["choices"]
    assert [r.status_code for r in same_session] == [200, 200]
    # one generation per explicit key, whose result is kept; a session's answer read in full is not kept, so
    # its body sent again is a new turn (a session retries only what it did not get)
    assert requests_total(cluster, 0) == 3
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{gateway.url}/metrics")).text
    assert 'rolloutgate_attachments_total{kind="live"} 1.0' in metrics
    assert 'rolloutgate_attachments_total{kind="cached"} 1.0' in metrics


# --- disconnects -------------------------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_a_disconnect_without_retry_is_aborted_after_the_grace_period(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    grace_sim = 1.0 * SCALE  # one loop second
    gateway = await make_gateway(cluster, retry_grace=grace_sim)
    engine = cluster.engines[0]
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                f"{gateway.url}/v1/chat/completions",
                json=chat(20_000),
                headers={"X-Rolloutgate-Keepalive": "off"},
            )
    loop = asyncio.get_running_loop()
    left_at = loop.time()
    assert engine.running_count == 1  # still generating: a retry could attach during the grace period
    await wait_until(lambda: engine.running_count == 0, timeout_s=10)
    assert loop.time() - left_at >= 0.8  # not before the grace period
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{gateway.url}/metrics")).text
    assert 'rolloutgate_aborts_sent_total{reason="client_gone"} 1.0' in metrics


@pytest.mark.looptime
async def test_a_retry_within_the_grace_period_gets_the_first_generation(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, retry_grace=10 * SCALE)
    headers = {"Idempotency-Key": "turn-42", "X-Rolloutgate-Keepalive": "off"}
    body = chat(int(2.5 * SCALE * 90))  # ~2.5 loop seconds of generation
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
    async with httpx.AsyncClient(timeout=30) as http:
        retry = await http.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
    assert retry.status_code == 200
    assert retry.json()["usage"]["completion_tokens"] == body["max_tokens"]
    assert requests_total(cluster, 0) == 1  # the retry got the first generation's answer


# --- errors after keep-alive -------------------------------------------------------------------------------------


@pytest.mark.parametrize("client", ["httpx", "openai", "litellm"])
@pytest.mark.looptime
async def test_an_error_after_keepalive_reaches_each_client_as_an_error(
    make_cluster: MakeCluster, make_gateway: MakeGateway, client: str
) -> None:
    """The request waits in the queue (keep-alive commits a 200), then runs over its budget: a 504 verdict
    that each real client must still see as an error, once, without retrying into a new generation."""
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, capacity=1)
    headers = {"X-Rolloutgate-Timeout": str(0.5 * SCALE)}  # half a loop second of engine time
    async with httpx.AsyncClient() as http:
        blocker = await start_blocker(http, gateway.url, 2 * CLIENT_TIMEOUT_S)
        await wait_until(lambda: cluster.engines[0].running_count == 1)
        body = chat(20_000)
        if client == "httpx":
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as c:
                response = await c.post(f"{gateway.url}/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200  # committed by keep-alive
            assert response.text.lstrip().startswith('{"error"')
            with pytest.raises(json.JSONDecodeError):
                response.json()
        elif client == "openai":
            sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="x", timeout=CLIENT_TIMEOUT_S)
            with pytest.raises(Exception) as raised:
                await sdk.chat.completions.create(
                    model="sim-model",
                    messages=MESSAGES,
                    max_tokens=20_000,
                    extra_headers=headers,
                    extra_body={"ignore_eos": True},
                )
            assert not isinstance(raised.value, openai.APITimeoutError)
            await sdk.close()
        else:
            with pytest.raises(Exception) as raised:
                await litellm.acompletion(
                    model="openai/sim-model",
                    api_base=f"{gateway.url}/v1",
                    api_key="x",
                    messages=MESSAGES,
                    max_tokens=20_000,
                    timeout=CLIENT_TIMEOUT_S,
                    extra_headers=headers,
                    ignore_eos=True,
                )
            assert "Timeout" not in type(raised.value).__name__
        await blocker
    assert requests_total(cluster, 0) == 2  # the blocker and one generation: no retry started another


@pytest.mark.looptime
async def test_a_client_gone_while_its_answer_is_written_is_a_quiet_disconnect(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Writing to a connection the client just closed raises ConnectionResetError (aiohttp's "Cannot write to
    closing transport"): a disconnect like any other (counted, generation aborted after the grace), not an
    error logged with a traceback, and the gateway goes on serving."""
    from aiohttp import ClientConnectionResetError

    from rolloutgate.server import front

    real_write_outcome = front.write_outcome
    calls = 0

    async def write_fails_once(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await real_write_outcome(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(front, "write_outcome", write_fails_once)
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, retry_grace=0.5 * SCALE)
    engine = cluster.engines[0]
    caplog.set_level("DEBUG", logger="aiohttp")
    async with httpx.AsyncClient(timeout=10) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(f"{gateway.url}/v1/chat/completions", json=chat(20_000, stream=True))
        # The reset can reach the client before the engine has read the request: see it start, then stop.
        await wait_until(lambda: engine.generated_tokens_total > 0, timeout_s=10)
        await wait_until(lambda: engine.running_count == 0, timeout_s=10)  # aborted after the grace
        served = await http.post(f"{gateway.url}/v1/chat/completions", json=chat(4))
        metrics = (await http.get(f"{gateway.url}/metrics")).text
    assert served.status_code == 200
    assert "rolloutgate_client_disconnects_total 1.0" in metrics
    assert 'rolloutgate_aborts_sent_total{reason="client_gone"} 1.0' in metrics
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert errors == [], [r.getMessage() for r in errors]
