"""The dashboard (deploy/grafana/rolloutgate.json) and the alert rules (deploy/prometheus/alerts.yml) ask only
for what a gateway exports: every metric, label and label value in their PromQL is found in `/metrics` of a real
gateway over simulated engines, driven through what the panels show (answers, a request stalled on two engines,
a closed gate with a request waiting, an engine frozen and quarantined). `job` and `instance` are the labels
Prometheus attaches to every scraped series. The rules' unit tests (alerts_test.yml) feed series of the same
names. promtool checks the rules themselves (`make check-rules`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rolloutsim.faults import Fault
from tests.deploy.promql import literal_alternatives, parse
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.users_path import gateway_error
from tests.sim.helpers import wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "rolloutgate.json"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
TARGET_LABELS = frozenset({"job", "instance"})  # attached by Prometheus to what it scrapes

# sample name -> label -> the values seen (over every scrape of the run)
Seen = dict[str, dict[str, set[str]]]


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # Grafana's label_values(metric, label): a selector and its label
            metric, label = variable["definition"].removeprefix("label_values(").rstrip(")").split(", ")
            exprs.append(f"count by ({label}) ({metric})")
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def rule_test_series() -> list[str]:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    return [series["series"] for test in tests for series in test["input_series"]]


def absorb(seen: Seen, text: str) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = seen.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)


def unknown(expr: str, seen: Seen) -> list[str]:
    """What `expr` names that the scrapes did not show: metrics, labels (matched or grouped on), values of
    `=`/`!=` matchers and of regex matchers that list literals."""
    parsed = parse(expr)
    problems: list[str] = []
    for selector in parsed.selectors:
        labels = seen.get(selector.metric)
        if labels is None:
            problems.append(f"metric {selector.metric}")
            continue
        for matcher in selector.matchers:
            if matcher.label in TARGET_LABELS:
                continue
            values = labels.get(matcher.label)
            if values is None:
                problems.append(f"label {selector.metric}{{{matcher.label}}}")
                continue
            wanted = [matcher.value] if matcher.op in ("=", "!=") else literal_alternatives(matcher.value)
            problems += [
                f"value {selector.metric}{{{matcher.label}={value!r}}}"
                for value in wanted or ()
                if value not in values
            ]
    selected = [seen.get(s.metric, {}) for s in parsed.selectors]
    for label in sorted(parsed.grouping - TARGET_LABELS):
        if not any(label in labels for labels in selected):
            problems.append(f"grouping label {label}")
    return problems


def test_the_check_finds_unknown_metrics_labels_and_values() -> None:
    seen: Seen = {}
    absorb(
        seen,
        'g{state="healthy",engine="e0"} 1\ng{state="quarantined",engine="e1"} 1\nc_total{reason="stall"} 2\n',
    )
    assert unknown('sum by (engine) (g{state="quarantined", instance=~"$instance"})', seen) == []
    assert unknown('rate(c_total{reason=~"stall"}[5m]) / on (job) count(g{state!="healthy"})', seen) == []
    assert unknown('g{state="quarantine"}', seen) == ["value g{state='quarantine'}"]
    assert unknown('g{state=~"healthy|hung"}', seen) == ["value g{state='hung'}"]
    assert unknown("sum by (reason) (g)", seen) == ["grouping label reason"]
    assert unknown("h_total + g{phase=~'.+'}", seen) == ["metric h_total", "label g{phase}"]


def test_every_expression_is_read_and_the_panels_tile_the_grid() -> None:
    for expr in dashboard_exprs() + rule_exprs() + rule_test_series():
        assert parse(expr).selectors, expr
    cells: set[tuple[int, int]] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]


CHAT = "/v1/chat/completions"


def chat(tokens: int, *, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "a turn of an agent's session " * 20}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def scrape(http: httpx.AsyncClient, url: str, seen: Seen) -> None:
    response = await http.get(f"{url}/metrics")
    assert response.status_code == 200
    absorb(seen, response.text)


@pytest.mark.looptime
async def test_every_metric_label_and_value_of_the_dashboard_and_the_rules_is_exported(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=2, time_scale=50.0)
    gateway = await make_gateway(cluster, stall_timeout=5.0, keepalive_interval=1.0)
    url, seen = gateway.url, {}
    # answers, with keep-alive bytes meanwhile, and one past its own 2 s budget of engine time
    timeout = {"X-Rolloutgate-Timeout": "2"}
    *answers, late = await asyncio.gather(
        *(http.post(url + CHAT, json=chat(300)) for _ in range(4)),
        http.post(url + CHAT, json=chat(3_000), headers=timeout),
    )
    assert [a.status_code for a in answers] == [200] * 4
    status, error = gateway_error(late)
    assert (status, error["code"]) == (504, "timeout"), error
    await scrape(http, url, seen)

    # a request stalled on both engines while each progresses for another: moved once, then failed "stall"
    busy = [asyncio.create_task(http.post(url + CHAT, json=chat(3_000))) for _ in range(2)]
    await wait_until(lambda: all(e.running_count for e in cluster.engines), "both engines busy")
    known = {rid for e in cluster.engines for rid in e.requests()}
    stalled = asyncio.create_task(http.post(url + CHAT, json=chat(3_000, stream=True)))
    await wait_until(lambda: sum(e.running_count for e in cluster.engines) == 3, "the third request running")
    (rid,) = {rid for e in cluster.engines for rid in e.requests()} - known
    request_id = rid.rpartition("-")[0]  # the engine sees the gateway's id and the attempt: <id>-01, <id>-02
    for engine in cluster.engines:
        for attempt in (1, 2):
            engine.set_fault(Fault(kind="stall", rid=f"{request_id}-{attempt:02d}"))
    events = [
        json.loads(line[6:]) for line in (await stalled).text.splitlines() if line.startswith("data: {")
    ]
    assert events[-1]["error"]["code"] == "stall", events[-1]  # the stream's last event is its error
    await asyncio.gather(*busy)
    await scrape(http, url, seen)

    # the gate closed with a request waiting: queue depth and queue age (the closed gate not counted)
    assert (await http.post(f"{url}/admin/pause", json={"mode": "in_place"})).status_code == 200
    waiting = asyncio.create_task(http.post(url + CHAT, json=chat(50)))
    await wait_until(lambda: gateway.context.driver.core.stats().queue_depth == 1, "a request queued")
    await asyncio.sleep(2.0)
    await scrape(http, url, seen)
    assert (await http.post(f"{url}/admin/resume", json={})).status_code == 200
    assert (await waiting).status_code == 200

    # an engine frozen while it works: quarantined, its request answered by the other
    frozen = cluster.engines[0]
    moved = [asyncio.create_task(http.post(url + CHAT, json=chat(400))) for _ in range(2)]
    await wait_until(lambda: frozen.running_count > 0, "a request on the engine to freeze")
    frozen.set_fault(Fault(kind="freeze"))
    assert [r.status_code for r in await asyncio.gather(*moved)] == [200, 200]
    await scrape(http, url, seen)

    exprs = dashboard_exprs() + rule_exprs() + rule_test_series()
    problems = {expr: found for expr in exprs if (found := unknown(expr, seen))}
    assert not problems, "\n".join(f"{expr}: {', '.join(found)}" for expr, found in problems.items())
