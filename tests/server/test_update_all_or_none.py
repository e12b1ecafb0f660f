"""`/admin/update_weights` all or none (server/admin.py `on_failure`): an engine whose update failed is taken
out before generation continues, or the others roll back to the previous weights; nothing is served on mixed
weights afterwards. The failure here is an engine gone when its update is sent (its process died)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import generate_body

UPDATE = {"path": "/update_weights_from_disk", "body": {"model_path": "/ckpt/7", "weight_version": "7"}}


async def served(http: httpx.AsyncClient, url: str, calls: int) -> list[str]:
    answers = await asyncio.gather(
        *(http.post(f"{url}/generate", json=generate_body(20, 30, first_id=1 + i)) for i in range(calls))
    )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    return [a.json()["meta_info"]["weight_version"] for a in answers]


@pytest.mark.parametrize(
    ("on_failure", "extra", "version", "rolled_back"),
    [
        ("exclude", {}, "7", []),
        ("rollback", {"rollback_body": {"model_path": "/ckpt/6", "weight_version": "default"}}, "default",
         ["engine-0", "engine-1"]),
    ],
)  # fmt: skip
async def test_a_failed_engine_is_taken_out_and_nothing_is_served_on_mixed_weights(
    make_cluster: MakeCluster,
    make_gateway: MakeGateway,
    http: httpx.AsyncClient,
    on_failure: str,
    extra: dict[str, object],
    version: str,
    rolled_back: list[str],
) -> None:
    cluster = await make_cluster(engines=3)
    gateway = await make_gateway(cluster)
    running = [
        asyncio.create_task(
            http.post(f"{gateway.url}/generate", json=generate_body(100, 400, first_id=50 + i))
        )
        for i in range(2)
    ]
    await cluster.engines[2].stop()  # its update cannot land
    answer = await http.post(
        f"{gateway.url}/admin/update_weights", json={**UPDATE, "on_failure": on_failure, **extra}
    )
    assert answer.status_code == 502, answer.text  # not every engine took the update: said, not hidden
    report = answer.json()
    assert [(e["engine"], e["ok"]) for e in report["engines"]] == [
        ("engine-0", True), ("engine-1", True), ("engine-2", False)
    ]  # fmt: skip
    assert report["excluded"] == ["engine-2"] and report["rolled_back"] == rolled_back
    workers = (await http.get(f"{gateway.url}/workers")).json()["workers"]
    assert [w["id"] for w in workers] == ["engine-0", "engine-1"]
    assert [e.weight_version for e in cluster.engines[:2]] == [version, version]
    for call in running:  # what ran across the update completes
        response = await call
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] == 400
    assert set(await served(http, gateway.url, 12)) == {version}


async def test_keep_reports_the_failed_engine_and_leaves_the_pool_as_it_was(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    await cluster.engines[1].stop()
    keep = {**UPDATE, "on_failure": "keep"}
    report = (await http.post(f"{gateway.url}/admin/update_weights", json=keep)).json()
    assert report["on_failure"] == "keep" and report["excluded"] == [] and not report["ok"]
    assert [w["id"] for w in (await http.get(f"{gateway.url}/workers")).json()["workers"]] == [
        "engine-0",
        "engine-1",
    ]


async def test_by_default_an_update_all_at_once_takes_a_failed_engine_out_and_a_staggered_one_keeps_it(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=3)
    gateway = await make_gateway(cluster)
    await cluster.engines[2].stop()
    staggered = (
        await http.post(f"{gateway.url}/admin/update_weights", json={**UPDATE, "staggered": True})
    ).json()
    assert staggered["on_failure"] == "keep" and staggered["excluded"] == [] and not staggered["ok"]
    report = (await http.post(f"{gateway.url}/admin/update_weights", json=UPDATE)).json()
    assert report["on_failure"] == "exclude" and report["excluded"] == ["engine-2"] and not report["ok"]
    workers = (await http.get(f"{gateway.url}/workers")).json()["workers"]
    assert [w["id"] for w in workers] == ["engine-0", "engine-1"]


@pytest.mark.parametrize(
    "body",
    [
        {**UPDATE, "on_failure": "retry"},
        {**UPDATE, "on_failure": "rollback"},  # no rollback_body
        {**UPDATE, "on_failure": "exclude", "staggered": True},
    ],
)
async def test_an_all_or_none_update_that_cannot_be_done_is_refused_before_anything_moves(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, body: dict[str, object]
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    refused = await http.post(f"{gateway.url}/admin/update_weights", json=body)
    assert refused.status_code == 400, refused.text
    assert cluster.engines[0].weight_version == "default" and not cluster.engines[0].paused


@pytest.mark.parametrize("on_failure", ["exclude", "rollback"])
async def test_an_update_every_engine_refused_takes_nothing_out_and_the_pool_serves_on(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, on_failure: str
) -> None:
    """A body every engine refuses (the trainer's mistake) leaves them all on the same weights: nothing is
    mixed, so nothing is taken out or rolled back (taking them out emptied the pool: tests/reliability)."""
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    for url in cluster.urls:  # every engine refuses the update (the simulator's update_fails fault)
        assert (await http.post(f"{url}/sim/faults", json={"fault": "update_fails"})).status_code == 200
    body = {**UPDATE, "on_failure": on_failure, "rollback_body": {"model_path": "/ckpt/6"}}
    report = (await http.post(f"{gateway.url}/admin/update_weights", json=body)).json()
    assert not report["ok"] and not any(e["ok"] for e in report["engines"]), report
    assert (report["excluded"], report["rolled_back"]) == ([], [])
    workers = (await http.get(f"{gateway.url}/workers")).json()["workers"]
    assert [w["id"] for w in workers] == ["engine-0", "engine-1"]
    assert set(await served(http, gateway.url, 4)) == {"default"}
