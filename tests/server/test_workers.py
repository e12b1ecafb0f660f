"""The engine pool's API in the miles router's dialect (server/workers.py): register by query or JSON body,
list, remove by URL; a prefill or decode worker is refused by name."""

from __future__ import annotations

import httpx

from rolloutgate.sim import SimCluster
from tests.server.conftest import MakeCluster, MakeGateway


async def test_register_list_and_remove_as_miles_does(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster: SimCluster = await make_cluster(engines=2)
    first, second = cluster.urls
    gateway = await make_gateway(engines=[])
    added = await http.post(f"{gateway.url}/add_worker", params={"url": first})
    assert added.status_code == 201, added.text
    added = await http.post(f"{gateway.url}/add_worker", json={"url": second})  # a JSON body
    assert added.status_code == 201, added.text
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [first, second]}
    removed = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
    assert removed.status_code == 200 and removed.json()["removed"]["url"] == first
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": [second]}
    missing = await http.post(f"{gateway.url}/remove_worker", params={"url": first})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "worker_not_found"
    nameless = await http.post(f"{gateway.url}/remove_worker")
    assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "url"


async def test_a_prefill_or_decode_worker_is_refused_by_name(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(engines=[])
    for worker_type in ("prefill", "decode"):
        refused = await http.post(
            f"{gateway.url}/workers", json={"url": cluster.urls[0], "worker_type": worker_type}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "unsupported_worker_type"
        refused = await http.post(
            f"{gateway.url}/add_worker", params={"url": cluster.urls[0], "worker_type": worker_type}
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "worker_type"
    assert (await http.get(f"{gateway.url}/list_workers")).json() == {"urls": []}
    regular = await http.post(
        f"{gateway.url}/workers", json={"url": cluster.urls[0], "worker_type": "regular"}
    )
    assert regular.status_code == 201, regular.text
