"""Bad input gets a 4xx OpenAI-shaped error, and the gateway keeps serving everyone else."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.config import EngineSpec
from rolloutgate.server.context import CONTEXT
from rolloutsim.faults import Fault
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.engine_tap import EngineTap

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if code is not None:
        assert error["code"] == code


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "m", "messages": "hi"}', 400, "invalid_type"),
        (b'{"model": "m", "messages": []}', 400, "invalid_type"),
        (b'{"model": "m", "messages": [{"content": "no role"}]}', 400, "invalid_type"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            400,
            "invalid_type",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            400,
            "invalid_value",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": true}',
            400,
            "invalid_type",
        ),
        (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_type"),
    ],
)
async def test_malformed_chat_bodies_get_400(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    body: bytes,
    status: int,
    code: str,
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    response = await http.post(
        f"{gateway.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert_openai_error(response, status, code)


async def test_generate_needs_exactly_one_input(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    both = await http.post(f"{gateway.url}/generate", json={"text": "a", "input_ids": [1, 2]})
    assert_openai_error(both, 400, "invalid_type")
    none = await http.post(f"{gateway.url}/generate", json={"sampling_params": {}})
    assert_openai_error(none, 400, "invalid_type")


async def test_oversized_body_gets_413(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1), max_body_bytes=4096)
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 10_000}]}
    response = await http.post(f"{gateway.url}/v1/chat/completions", json=big)
    assert_openai_error(response, 413)

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the size is known only by reading
        body = orjson.dumps(big)
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    streamed = await http.post(
        f"{gateway.url}/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert_openai_error(streamed, 413)


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("X-Rolloutgate-Timeout", "abc"),
        ("X-Rolloutgate-Timeout", "-5"),
        ("X-Rolloutgate-Timeout", "nan"),
        ("X-Rolloutgate-Timeout", "999999"),
        ("X-Rolloutgate-Stall-Timeout", "0"),
        ("X-Rolloutgate-Queue-Timeout", "inf"),
        ("X-Rolloutgate-Priority", "high"),
    ],
)
async def test_invalid_overrides_get_400(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, header: str, value: str
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    response = await http.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers={header: value})
    assert_openai_error(response, 400, "invalid_override")


async def test_unknown_worker_gets_404_and_bad_worker_url_400(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    missing = await http.delete(f"{gateway.url}/workers/engine-99")
    assert_openai_error(missing, 404, "worker_not_found")
    bad_scheme = await http.post(f"{gateway.url}/workers", json={"url": "file:///etc/passwd"})
    assert_openai_error(bad_scheme, 400, "invalid_worker")
    no_url = await http.post(f"{gateway.url}/workers", json={"family": "sglang"})
    assert_openai_error(no_url, 400, "invalid_worker")


async def test_gateway_keeps_serving_while_bad_requests_arrive(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    gateway = await make_gateway(await make_cluster(engines=1))
    good = [http.post(f"{gateway.url}/v1/chat/completions", json=CHAT) for _ in range(8)]
    bad = [
        http.post(
            f"{gateway.url}/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}
        )
        for _ in range(8)
    ]
    results = await asyncio.gather(*good, *bad)
    assert [r.status_code for r in results[:8]] == [200] * 8
    assert all(r.json()["choices"][0]["message"]["content"] for r in results[:8])
    assert [r.status_code for r in results[8:]] == [400] * 8


# -- token ids outside the engine's vocabulary (server/validate.py `check_token_ids`) ----------------------

SIM_VOCAB = 1000  # the simulated engine's, learned by the gateway from its /server_info
LARGE = 2_000  # ids: a body past prompt_ids.FIELD_WISE_FROM, kept as its JSON (the scanned path)


@pytest.fixture
async def tapped_gateway(
    make_cluster: MakeCluster, make_gateway: MakeGateway
) -> AsyncIterator[tuple[str, EngineTap]]:
    """A gateway whose one engine, a simulator of SIM_VOCAB ids, sits behind a tap that records each call."""
    cluster = await make_cluster(engines=1, vocab_size=SIM_VOCAB)
    tap = await EngineTap(cluster.urls[0]).start()
    try:
        gateway = await make_gateway(engines=[EngineSpec(url=tap.url, family="sglang")], time_scale=100.0)
        assert gateway.app[CONTEXT].pool.vocab_size == SIM_VOCAB
        yield gateway.url, tap
    finally:
        await tap.close()


@pytest.mark.parametrize(
    ("path", "body", "where", "code"),
    [
        ("/generate", {"input_ids": [5, SIM_VOCAB]}, "input_ids[1]", "token_id_out_of_vocabulary"),
        ("/generate", {"input_ids": [999_999]}, "input_ids[0]", "token_id_out_of_vocabulary"),
        (
            "/generate",
            {"input_ids": [5] * LARGE + [SIM_VOCAB + 7]},
            f"input_ids[{LARGE}]",
            "token_id_out_of_vocabulary",
        ),
        ("/generate", {"input_ids": [5, -1]}, "input_ids[1]", "invalid_token_id"),
        ("/generate", {"input_ids": [5] * LARGE + [-1]}, f"input_ids[{LARGE}]", "invalid_token_id"),
        ("/generate", {"input_ids": [[5], [6, SIM_VOCAB]]}, "input_ids[1][1]", "token_id_out_of_vocabulary"),
        (
            "/generate",
            {"input_ids": [[5] * LARGE, [SIM_VOCAB]]},
            "input_ids[1][0]",
            "token_id_out_of_vocabulary",
        ),
        ("/generate", {"input_ids": [5, 1.5]}, "input_ids[1]", "invalid_token_id"),
        (
            "/v1/completions",
            {"model": "m", "prompt": [5, SIM_VOCAB]},
            "prompt[1]",
            "token_id_out_of_vocabulary",
        ),
        (
            "/v1/completions",
            {"model": "m", "prompt": [5] * LARGE + [-3]},
            f"prompt[{LARGE}]",
            "invalid_token_id",
        ),
    ],
)
async def test_ids_outside_the_vocabulary_never_reach_the_engine(
    tapped_gateway: tuple[str, EngineTap],
    http: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    where: str,
    code: str,
) -> None:
    url, tap = tapped_gateway
    refused = await http.post(url + path, json=body)
    assert_openai_error(refused, 400, code)
    assert refused.json()["error"]["message"].startswith(f"'{where}'")
    assert not tap.calls  # the engine never saw it
    served = await http.post(url + "/generate", json={"input_ids": [5, SIM_VOCAB - 1], "sampling_params": {}})
    assert served.status_code == 200, served.text
    assert [c.path for c in tap.calls] == ["/generate"]


async def test_a_session_path_checks_the_ids_it_proxies(
    tapped_gateway: tuple[str, EngineTap], http: httpx.AsyncClient
) -> None:
    url, tap = tapped_gateway
    session_id = (await http.post(f"{url}/sessions")).json()["session_id"]
    refused = await http.post(f"{url}/sessions/{session_id}/generate", json={"input_ids": [1, SIM_VOCAB]})
    assert_openai_error(refused, 400, "token_id_out_of_vocabulary")
    assert not tap.calls
    served = await http.post(f"{url}/sessions/{session_id}/generate", json={"input_ids": [1, 2]})
    assert served.status_code == 200, served.text


# -- an engine that dies anyway ---------------------------------------------------------------------------


async def test_a_call_two_engines_died_prefilling_is_not_sent_to_a_third_nor_is_its_retry(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    # A prompt the vocabulary check does not know kills each engine that prefills it (as SGLang 0.5.9 dies on an
    # id it cannot embed): staged by crashing whichever engine is prefilling the call.
    cluster = await make_cluster(engines=3, time_scale=1.0)  # a 20K-token prefill takes ~2 s
    gateway = await make_gateway(cluster, keepalive_interval=0, max_attempts=5)
    killer = {"input_ids": [7] * 20_000, "sampling_params": {}}
    call = asyncio.create_task(http.post(f"{gateway.url}/generate", json=killer))

    def prefilling() -> list[Any]:
        return [
            e for e in cluster.engines if any(r.state.value == "prefilling" for r in e.requests().values())
        ]

    killed: list[Any] = []
    for _ in range(2):
        for _ in range(500):
            if prefilling():
                break
            await asyncio.sleep(0.01)
        (engine,) = prefilling()
        engine.set_fault(Fault(kind="crash"))
        killed.append(engine)
    response = await call
    assert_openai_error(response, 502, "engine_lost_in_prefill")
    (third,) = (e for e in cluster.engines if e not in killed)
    assert third.model.stats.requests_total == 0, "the call that killed two engines was sent to a third"
    # its client's retry (a new request, another rid, a stream) is refused before any engine sees it
    retried = {**killer, "rid": "retry-1", "stream": True, "sampling_params": {"temperature": 0.7}}
    refused = await http.post(f"{gateway.url}/generate", json=retried)
    assert_openai_error(refused, 400, "prompt_lost_engines")
    assert third.model.stats.requests_total == 0, "the client's retry of the killer reached the third engine"
    session_id = (await http.post(f"{gateway.url}/sessions")).json()["session_id"]
    refused = await http.post(f"{gateway.url}/sessions/{session_id}/generate", json=killer)
    assert_openai_error(refused, 400, "prompt_lost_engines")
    assert (await http.get(f"{gateway.url}/sessions/{session_id}")).json()["records"] == []
    assert third.model.stats.requests_total == 0
    served = await http.post(f"{gateway.url}/generate", json={"input_ids": [1, 2], "sampling_params": {}})
    assert served.status_code == 200, served.text
    metrics = (await http.get(f"{gateway.url}/metrics")).text
    assert 'rolloutgate_failures_total{reason="engine_lost_in_prefill"} 1.0' in metrics
    assert 'rolloutgate_bad_requests_total{code="prompt_lost_engines"} 2.0' in metrics  # the retry, the turn
    lost = [line for line in metrics.splitlines() if line.startswith("rolloutgate_engine_calls_lost_total{")]
    assert len(lost) == 2 and all(line.endswith(" 1.0") for line in lost), lost  # each death on its engine
