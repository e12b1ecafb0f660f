"""Sessions at the edge: `POST /finish_session?session_id=` (server/finish_session.py), vllm-router's release
of a session's binding as prime-rl and SkyRL call it, seen in where the next new session is placed; and
`--session-max-in-flight` (core/session_cap.py), seen in how the engine runs a session's calls."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from tests.server.conftest import MakeCluster, MakeGateway

SCALE = 100.0


def chat(session: str) -> tuple[dict[str, object], dict[str, str]]:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": f"hi {session}"}], "max_tokens": 4}
    return body, {"X-Session-Id": session}


async def engine_of(http: httpx.AsyncClient, url: str, session: str) -> str:
    body, headers = chat(session)
    answer = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.headers["X-Rolloutgate-Engine"]


@pytest.mark.looptime
async def test_finished_sessions_no_longer_count_where_the_next_new_session_goes(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """Sessions a, b, c land two on one engine (A) and one on the other; a and c finish, so the next new
    session goes to A, which now holds none (unfinished, A would hold two and d would go to the other)."""
    cluster = await make_cluster(engines=2, time_scale=SCALE)
    gateway = await make_gateway(cluster, placement="cache_warm", api_keys=["k"])
    http.headers["Authorization"] = "Bearer k"
    a, b, c = [await engine_of(http, gateway.url, s) for s in ("a", "b", "c")]
    assert a == c != b
    for session in ("a", "c", "never-seen"):  # an id that is not bound answers the same: idempotent
        answer = await http.post(f"{gateway.url}/finish_session", params={"session_id": session})
        assert answer.status_code == 200 and answer.json() == {"session_id": session, "finished": True}
    assert await engine_of(http, gateway.url, "d") == a
    assert await engine_of(http, gateway.url, "b") == b  # a live session keeps its engine


@pytest.mark.looptime
async def test_a_finish_without_an_id_or_a_key_is_refused_and_the_gateway_serves_on(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, api_keys=["k"])
    unkeyed = await http.post(f"{gateway.url}/finish_session", params={"session_id": "a"})
    assert unkeyed.status_code == 401 and unkeyed.json()["error"]["type"]
    http.headers["Authorization"] = "Bearer k"
    for params in ({}, {"session_id": "  "}):
        answer = await http.post(f"{gateway.url}/finish_session", params=params)
        assert answer.status_code == 400
        assert answer.json()["error"]["code"] == "invalid_session_id"
        assert answer.json()["error"]["param"] == "session_id"
    assert await engine_of(http, gateway.url, "a") == cluster.urls[0]


@pytest.mark.looptime
async def test_with_a_cap_of_one_a_sessions_calls_reach_the_engine_one_after_another(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """`--session-max-in-flight 1` (core/session_cap.py): three calls of one session sent at once are all
    answered, and the engine runs them one at a time; another session's call is not held behind them."""
    cluster = await make_cluster(engines=1, time_scale=SCALE)
    gateway = await make_gateway(cluster, session_max_in_flight=1)
    calls = [  # bodies that differ: the same body again would be a retry, attached to the first (attach.py)
        http.post(
            f"{gateway.url}/generate",
            json={
                "input_ids": [i, *range(1, 200)],
                "sampling_params": {"max_new_tokens": 60, "ignore_eos": True},
            },
            headers={"X-Session-Id": key},
        )
        for i, key in enumerate(("s", "s", "s", "other"), start=1)
    ]
    answers = await asyncio.gather(*calls)
    assert [a.status_code for a in answers] == [200] * 4
    runs = sorted(
        (r.arrived_at, r.finished_at)
        for r in cluster.engines[0].model.requests()
        if r.arrived_at is not None and r.finished_at is not None
    )
    assert len(runs) == 4
    overlaps = sum(a_end > b_start for (_, a_end), (b_start, _) in itertools.pairwise(runs))
    assert overlaps == 1, runs  # only "other" ran beside one of the session's calls
