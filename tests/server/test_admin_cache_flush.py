"""A weight update empties the engines' prefix caches, and the gateway's placement learns it: sessions keep their
engine, but their next turn is priced as a cold prefill (core/session_table.py `forget_cached`)."""

from __future__ import annotations

import httpx

from tests.server.conftest import MakeCluster, MakeGateway

SESSION = {"X-Session-Id": "agent-7"}


async def one_turn(http: httpx.AsyncClient, url: str, turn: int = 1) -> str:
    # (Each turn's body differs: the same body again in the same session would attach to the first answer.)
    messages = [{"role": "user", "content": f"turn {i}: " + "hi " * 200} for i in range(turn)]
    response = await http.post(
        f"{url}/v1/chat/completions",
        json={"model": "sim-model", "messages": messages, "max_tokens": 8},
        headers=SESSION,
    )
    assert response.status_code == 200, response.text
    return response.headers["X-Rolloutgate-Engine"]


async def test_update_weights_forgets_what_each_engine_had_cached(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    core = gateway.context.driver.core
    await one_turn(http, gateway.url)
    placed = core.session_placement("agent-7")
    assert placed is not None and placed[1] > 100  # the prompt and the answer are on that engine now
    update = await http.post(
        f"{gateway.url}/admin/update_weights",
        json={"path": "/update_weights_from_disk", "body": {"model_path": "v2"}, "mode": "in_place"},
    )
    assert update.status_code == 200, update.text
    assert core.session_placement("agent-7") == (placed[0], 0)
    await one_turn(
        http, gateway.url, turn=2
    )  # the session's next turn stays on its engine and warms it again
    after = core.session_placement("agent-7")
    assert after is not None and after[0] == placed[0] and after[1] > 100


async def test_resume_after_an_update_made_outside_the_gateway(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    core = gateway.context.driver.core
    await one_turn(http, gateway.url)
    placed = core.session_placement("agent-7")
    assert placed is not None and placed[1] > 0
    for body, cached in ((None, placed[1]), ({"weights_updated": True}, 0)):
        assert (await http.post(f"{gateway.url}/admin/pause", json={"mode": "in_place"})).status_code == 200
        resumed = await http.post(f"{gateway.url}/admin/resume", json=body)
        assert resumed.status_code == 200, resumed.text
        assert core.session_placement("agent-7") == (placed[0], cached)
    await http.post(f"{gateway.url}/admin/pause", json={"mode": "in_place"})
    bad = await http.post(f"{gateway.url}/admin/resume", json={"weights_updated": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weights_updated"
