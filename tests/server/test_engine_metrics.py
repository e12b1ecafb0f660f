"""`GET /engine_metrics` (server/engine_metrics.py): every engine's own metrics in one scrape, labelled."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rolloutgate.server.engine_metrics import UP_METRIC, merge_scrapes
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import generate_body


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


async def test_one_scrape_holds_every_engines_metrics_under_its_own_labels(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2)
    gateway = await make_gateway(cluster)
    assert (await http.post(f"{cluster.urls[1]}/generate", json=generate_body(64, 8))).status_code == 200
    response = await http.get(f"{gateway.url}/engine_metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = _families(response.text)
    direct = [_families((await http.get(f"{url}/metrics")).text) for url in cluster.urls]
    name = "sglang:generation_tokens"  # a counter: the parser names the family without `_total`
    assert name in families
    by_engine = {labels["engine"]: (labels["engine_url"], value) for labels, value in families[name]}
    ids = sorted(by_engine)
    assert [by_engine[i][0] for i in ids] == cluster.urls
    # each engine's value is its own, unchanged
    assert [by_engine[i][1] for i in ids] == [d[name][0][1] for d in direct]
    assert by_engine[ids[1]][1] >= 8 and by_engine[ids[0]][1] == 0
    assert sorted(value for _, value in families[UP_METRIC]) == [1.0, 1.0]


def test_an_engine_that_did_not_answer_is_marked_down_and_the_others_kept() -> None:
    text = '# HELP x_total a counter\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n'
    merged = merge_scrapes([("engine-0", "http://a:1", text), ("engine-1", "http://b:2", None)])
    families = _families(merged.decode())
    assert families["x"] == [({"model_name": "m", "engine": "engine-0", "engine_url": "http://a:1"}, 3.0)]
    assert sorted(families[UP_METRIC], key=lambda s: s[0]["engine"]) == [
        ({"engine": "engine-0"}, 1.0),
        ({"engine": "engine-1"}, 0.0),
    ]
