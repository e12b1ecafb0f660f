"""Weight versions per token and the staleness bound through the gateway (issue 23, items 1 and 2), on the
simulator over loopback HTTP: a session turn whose long decode crosses an in-place update through
`/admin/update_weights` carries two spans in its record, its trajectory and miles' samples, whose lengths add
up to the answer; with `max_staleness` a request that started too many versions back is re-run from scratch
on the new weights ("requeue") or answered with its partial output, finish reason abort ("partial")."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutsim import SimCluster
from tests.server.conftest import MakeCluster, MakeGateway
from tests.server.test_sessions_samples import decode
from tests.sessions.fixtures import build_tiny_tokenizer
from tests.sim.helpers import wait_until

pytestmark = pytest.mark.looptime

SCALE = 50.0
TOKENS = 3_000  # ~33 simulated seconds of decode
MID_DECODE = 1_000  # the update lands once the engine has generated this many of them
UPDATE = {
    "path": "/update_weights_from_disk",
    "body": {"model_path": "/ckpt/step-1", "weight_version": "step-1"},
    "mode": "in_place",
}


async def _update_mid_decode(http: httpx.AsyncClient, url: str, cluster: SimCluster) -> int:
    """`/admin/update_weights` in place once the engine's one request is MID_DECODE tokens in; returns how
    many tokens it had then (the engine is paused in place before the update, so no more come under the old
    weights after that instant than the engine reports at its pause)."""
    engine = cluster.engines[0]
    await wait_until(lambda: any(r.completion_tokens >= MID_DECODE for r in engine.model.requests()))
    report = await http.post(f"{url}/admin/update_weights", json=UPDATE)
    assert report.status_code == 200 and report.json()["ok"], report.text
    return MID_DECODE


def _stale_counts(metrics: str) -> dict[str, float]:
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^rolloutgate_stale_requests_total\{action="(\w+)"\} (\S+)$', metrics, re.M)
    }


async def test_a_turn_that_crosses_an_in_place_update_has_two_spans_everywhere(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    tokenizer = str(build_tiny_tokenizer(tmp_path / "tok"))
    gateway = await make_gateway(cluster, tokenizer=tokenizer)
    url = gateway.url
    session_id = (await http.post(f"{url}/sessions")).json()["session_id"]
    turn = asyncio.create_task(
        http.post(
            f"{url}/sessions/{session_id}/v1/chat/completions",
            json={
                "model": "sim-model",
                "messages": [{"role": "user", "content": "a long rollout"}],
                "max_tokens": TOKENS,
                "ignore_eos": True,
            },
        )
    )
    await _update_mid_decode(http, url, cluster)
    answer = await turn
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == TOKENS

    (record,) = (await http.get(f"{url}/sessions/{session_id}")).json()["records"]
    spans = record["weight_versions"]  # offsets in the output, as the engine reported them
    assert [s["version"] for s in spans] == ["default", "step-1"] and spans[0]["start"] == 0
    boundary = spans[0]["end"]
    assert MID_DECODE <= boundary < TOKENS and spans[1] == {
        "version": "step-1",
        "start": boundary,
        "end": TOKENS,
    }
    assert sum(s["end"] - s["start"] for s in spans) == len(record["output_token_ids"]) == TOKENS
    assert record["weight_version"] == "step-1"
    assert record["response"]["choices"][0]["meta_info"]["weight_versions"] == spans  # what miles reads

    trajectory = (await http.get(f"{url}/sessions/{session_id}/trajectory")).json()
    prompt = trajectory["prompt_length"]
    expected = [
        {"version": "default", "abs_start": prompt, "abs_end": prompt + boundary},
        {"version": "step-1", "abs_start": prompt + boundary, "abs_end": prompt + TOKENS},
    ]
    assert trajectory["turns"][0]["weight_versions"] == expected

    samples = await http.post(f"{url}/sessions/{session_id}/samples", json={"max_seq_len": None})
    (sample,), _ = decode(samples.content)
    assert sample["weight_versions"] == [expected]  # one list per merged call: this call's two spans
    assert (
        sum(s["abs_end"] - s["abs_start"] for s in sample["weight_versions"][0]) == sample["response_length"]
    )

    weights = (await http.get(f"{url}/admin/state")).json()["weights"]
    assert weights == {"version": 1, "engine_version": "step-1", "stale_requeued": 0, "stale_partial": 0}
    print(
        f"\nweight versions figure: one {TOKENS}-token turn, in-place update at {boundary} tokens: spans "
        f"{boundary} (default) + {TOKENS - boundary} (step-1) = {TOKENS}"
    )


def _generate(rid: str) -> dict[str, Any]:
    return {
        "input_ids": [11, 12, 13, 14],
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True},
    }


async def test_requeue_reruns_a_stale_request_from_scratch_on_the_new_weights(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    gateway = await make_gateway(cluster, max_staleness=0, on_stale="requeue")
    url = gateway.url
    call = asyncio.create_task(http.post(f"{url}/generate", json=_generate("stale")))
    await _update_mid_decode(http, url, cluster)
    answer = await call
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    # the re-run generated every token on the new weights: one version, no spans, no abort
    assert (meta["finish_reason"]["type"], meta["completion_tokens"]) == ("length", TOKENS)
    assert meta["weight_version"] == "step-1" and "weight_versions" not in meta
    assert cluster.engines[0].state(include_requests=False)["aborted_total"] == 1  # the stale attempt
    metrics = (await http.get(f"{url}/metrics")).text
    assert _stale_counts(metrics) == {"requeued": 1.0} and "\nrolloutgate_redispatches_total 1.0" in metrics
    weights = (await http.get(f"{url}/admin/state")).json()["weights"]
    assert (weights["stale_requeued"], weights["stale_partial"]) == (1, 0)
    (lost,) = [
        r.completion_tokens
        for r in cluster.engines[0].requests().values()
        if r.finish is not None and r.finish.sglang()["type"] == "abort"
    ]
    print(
        f"\nstaleness figure (requeue): 1 request aborted at {lost} of {TOKENS} tokens, re-run: "
        f"{meta['completion_tokens']} tokens all on step-1, 1 re-dispatch, no client error"
    )


async def test_partial_answers_a_stale_request_with_its_tokens_so_far_and_finish_reason_abort(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    tokenizer = str(build_tiny_tokenizer(tmp_path / "tok"))
    gateway = await make_gateway(cluster, tokenizer=tokenizer, max_staleness=0, on_stale="partial")
    url = gateway.url
    session_id = (await http.post(f"{url}/sessions")).json()["session_id"]
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "a long rollout"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
    }
    turn = asyncio.create_task(http.post(f"{url}/sessions/{session_id}/v1/chat/completions", json=body))
    await _update_mid_decode(http, url, cluster)
    answer = await turn
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    generated = answer.json()["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "abort" and MID_DECODE <= generated < TOKENS
    (record,) = (await http.get(f"{url}/sessions/{session_id}")).json()["records"]
    assert record["finish_reason"] == "abort" and len(record["output_token_ids"]) == generated
    samples = await http.post(f"{url}/sessions/{session_id}/samples", json={"max_seq_len": None})
    (sample,), _ = decode(samples.content)
    assert sample["status"] == "aborted" and sample["response_length"] == generated  # miles' partial sample
    assert _stale_counts((await http.get(f"{url}/metrics")).text) == {"partial": 1.0}
    print(
        f"\nstaleness figure (partial): 1 request answered at {generated} of {TOKENS} tokens, finish "
        "reason abort, sample status aborted"
    )


async def test_within_the_bound_a_request_runs_on_across_the_update(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    gateway = await make_gateway(cluster, max_staleness=1, on_stale="partial")
    url = gateway.url
    call = asyncio.create_task(http.post(f"{url}/generate", json=_generate("fresh")))
    boundary = await _update_mid_decode(http, url, cluster)
    answer = await call
    meta = answer.json()["meta_info"]
    assert (meta["finish_reason"]["type"], meta["completion_tokens"]) == ("length", TOKENS)
    assert [s["version"] for s in meta["weight_versions"]] == ["default", "step-1"]
    assert meta["weight_versions"][0]["end"] >= boundary
    assert cluster.engines[0].state(include_requests=False)["aborted_total"] == 0
    assert _stale_counts((await http.get(f"{url}/metrics")).text) == {}


async def test_at_each_update_only_those_past_the_bound_are_rerun_and_the_others_run_on(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """max_staleness 1: a wave started under version 0 lives through update 1 and is re-run at update 2; the
    wave started under version 1 runs on through update 2, its answers in two spans."""
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    gateway = await make_gateway(cluster, max_staleness=1, on_stale="requeue")
    url, engine = gateway.url, cluster.engines[0]

    def call(rid: str, tokens: int) -> asyncio.Task[httpx.Response]:
        body = {**_generate(rid), "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
        return asyncio.create_task(http.post(f"{url}/generate", json=body))

    async def update(version: str, running: int) -> None:
        """Once `running` requests run on the engine, each 500 tokens in or more."""
        await wait_until(
            lambda: (
                engine.running_count == running
                and all(r.completion_tokens >= 500 for r in engine.model.requests())
            )
        )
        body = {**UPDATE, "body": {"model_path": f"/ckpt/{version}", "weight_version": version}}
        assert (await http.post(f"{url}/admin/update_weights", json=body)).json()["ok"]

    first = [call(f"first-{i}", 2 * TOKENS) for i in range(3)]
    await update("step-1", running=3)
    second = [call(f"second-{i}", TOKENS) for i in range(3)]
    await update("step-2", running=6)
    answers = [(await t).json()["meta_info"] for t in (*first, *second)]
    assert all(m["finish_reason"]["type"] == "length" for m in answers)
    rerun, ran_on = answers[:3], answers[3:]
    assert all("weight_versions" not in m and m["weight_version"] == "step-2" for m in rerun)
    assert all([s["version"] for s in m["weight_versions"]] == ["step-1", "step-2"] for m in ran_on)
    assert _stale_counts((await http.get(f"{url}/metrics")).text) == {"requeued": 3.0}
    print(
        "\nstaleness figure (max_staleness 1, two updates): 3 started under version 0 re-run from scratch on "
        f"step-2, 3 started under version 1 ran on in two spans ({[m['weight_versions'][0]['end'] for m in ran_on]}"
        " tokens under step-1), 0 client errors"
    )


async def test_a_trainers_own_update_counts_once_the_gateway_is_told_at_resume(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """miles' way, announced: `/admin/pause {"mode": "external"}`, the trainer's own pause, update and continue
    on the engine, then `/admin/resume {"weights_updated": true}`: one more version, and the staleness bound
    applies to what the update found running."""
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    gateway = await make_gateway(cluster, max_staleness=0, on_stale="requeue")
    url, engine = gateway.url, cluster.engines[0]
    call = asyncio.create_task(http.post(f"{url}/generate", json=_generate("trainer")))
    await wait_until(lambda: any(r.completion_tokens >= MID_DECODE for r in engine.model.requests()))
    assert (await http.post(f"{url}/admin/pause", json={"mode": "external"})).status_code == 200
    for path, body in (
        ("/pause_generation", {"mode": "in_place"}),
        ("/update_weights_from_disk", {"model_path": "/ckpt/step-1", "weight_version": "step-1"}),
        ("/continue_generation", {}),
    ):
        assert (await http.post(engine.url + path, json=body)).status_code == 200
    assert (await http.get(f"{url}/admin/state")).json()["weights"]["version"] == 0  # not told yet
    assert (await http.post(f"{url}/admin/resume", json={"weights_updated": True})).status_code == 200
    meta = (await call).json()["meta_info"]
    assert (meta["completion_tokens"], meta["weight_version"]) == (TOKENS, "step-1")
    assert "weight_versions" not in meta  # re-run from scratch on the new weights
    weights = (await http.get(f"{url}/admin/state")).json()["weights"]
    assert (weights["version"], weights["engine_version"], weights["stale_requeued"]) == (1, None, 1)


async def test_pace_aborts_nothing_and_holds_new_work_until_the_update(
    make_cluster: MakeCluster, make_gateway: MakeGateway, http: httpx.AsyncClient
) -> None:
    """`--on-stale pace` (core/pace.py), batch 1 and K 0: one generation may run per version. The second waits
    in the gateway; the update lets it in, and the first runs on across it to its full length (two spans)."""
    cluster = await make_cluster(engines=1, time_scale=SCALE, weight_update_s=5.0)
    gateway = await make_gateway(cluster, max_staleness=0, on_stale="pace", pace_batch=1)
    url = gateway.url
    first = asyncio.create_task(http.post(f"{url}/generate", json=_generate("first")))
    await wait_until(lambda: cluster.engines[0].running_count == 1)
    second = asyncio.create_task(http.post(f"{url}/generate", json=_generate("second")))
    await wait_until(lambda: gateway.context.driver.core.stats().queue_depth == 1)
    assert cluster.engines[0].running_count == 1  # held in the gateway, not sent
    await _update_mid_decode(http, url, cluster)
    answers = [await first, await second]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    kept = answers[0].json()["meta_info"]
    assert (kept["finish_reason"]["type"], kept["completion_tokens"]) == ("length", TOKENS)
    assert [s["version"] for s in kept["weight_versions"]] == ["default", "step-1"]
    assert answers[1].json()["meta_info"]["weight_version"] == "step-1"  # admitted after the update
    assert cluster.engines[0].state(include_requests=False)["aborted_total"] == 0
    assert _stale_counts((await http.get(f"{url}/metrics")).text) == {}
