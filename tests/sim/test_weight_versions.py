"""The simulator's weight versions per token: a generation that crosses an in-place weight update answers with
one `meta_info.weight_versions` span per version (SGLang's output offsets), whose lengths add up to its
output; one that crossed none has only `weight_version`."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from rolloutsim.ledger import GenerationLedger

from .conftest import ClusterFactory
from .helpers import post_json, wait_until

SCALE = 50.0
pytestmark = pytest.mark.looptime


async def test_an_in_place_update_mid_decode_splits_the_answer_into_two_spans(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE, weight_update_s=1.0)
    url, engine = cluster.urls[0], cluster.engines[0]
    body = {"input_ids": [5, 6, 7], "rid": "long", "return_logprob": True}
    long = asyncio.create_task(
        post_json(session, url + "/generate", {**body, "sampling_params": {"max_new_tokens": 600}})
    )
    await wait_until(lambda: (r := engine.request("long")) is not None and r.completion_tokens > 100)
    await post_json(session, url + "/pause_generation", {"mode": "in_place"})
    req = engine.request("long")
    assert req is not None
    before = req.completion_tokens
    status, _ = await post_json(
        session, url + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}
    )
    assert status == 200
    await post_json(session, url + "/continue_generation", {})
    status, answer = await long
    meta = answer["meta_info"]
    assert status == 200 and meta["completion_tokens"] == 600 and meta["weight_version"] == "v2"
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": before},
        {"version": "v2", "start": before, "end": 600},
    ]
    assert sum(s["end"] - s["start"] for s in meta["weight_versions"]) == len(meta["output_token_logprobs"])
    # a call that started after the update crossed none: one version, no spans
    _, after = await post_json(session, url + "/generate", {**body, "rid": "new", "sampling_params": {}})
    assert after["meta_info"]["weight_version"] == "v2" and "weight_versions" not in after["meta_info"]


async def test_two_updates_mid_decode_give_three_spans(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    long = asyncio.create_task(
        post_json(
            session,
            url + "/generate",
            {"input_ids": [1, 2], "rid": "x", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}},
        )
    )
    marks = []
    for version, at in (("v1", 200), ("v2", 500)):
        await wait_until(lambda at=at: (r := engine.request("x")) is not None and r.completion_tokens >= at)
        await post_json(
            session, url + "/update_weight_version", {"new_version": version, "abort_all_requests": False}
        )
        req = engine.request("x")
        assert req is not None
        marks.append(req.completion_tokens)
    _, answer = await long
    spans = answer["meta_info"]["weight_versions"]
    assert [(s["version"], s["start"], s["end"]) for s in spans] == [
        ("default", 0, marks[0]),
        ("v1", marks[0], marks[1]),
        ("v2", marks[1], 900),
    ]
    engine.set_weight_version("v3")  # nothing running: nobody's spans change
    engine.set_weight_version("v3")  # the same version again is no update
    assert engine.weight_version == "v3"


# --- a restart holds the launch checkpoint; a failed update keeps the old weights (sim/faults.py) -------------


async def server_version(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/server_info") as response:
        return str((await response.json())["weight_version"])


async def test_a_restart_comes_back_holding_the_weights_it_was_launched_with(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    status, _ = await post_json(
        session, url + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}
    )
    assert status == 200 and await server_version(session, url) == "v2"
    engine.set_fault("restart", down_s=5.0, duration_s=5.0)
    await wait_until(lambda: not engine.is_starting, timeout_s=20.0 / SCALE)
    # a new process loads its checkpoint: the update the old one took is gone
    assert await server_version(session, url) == "default"
    status, answer = await post_json(session, url + "/generate", {"input_ids": [1], "sampling_params": {}})
    assert status == 200 and answer["meta_info"]["weight_version"] == "default"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}),
        ("/update_weight_version", {"new_version": "v2", "abort_all_requests": False}),
    ],
)
async def test_under_update_fails_an_update_answers_failure_and_the_old_weights_stay(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession, path: str, body: dict[str, object]
) -> None:
    cluster = await make_cluster(time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    status, listed = await post_json(session, url + "/sim/faults", {"fault": "update_fails"})
    assert status == 200 and listed["faults"] == [{"kind": "update_fails", "engine": 0}]
    status, answer = await post_json(session, url + path, body)
    assert status == 400 and answer["success"] is False and "update_fails" in answer["message"]
    assert engine.weight_version == "default" and await server_version(session, url) == "default"
    engine.clear_faults("update_fails")
    status, answer = await post_json(session, url + path, body)
    assert status == 200 and answer["success"] is True and await server_version(session, url) == "v2"


async def test_under_update_fails_vllm_answers_an_error_and_keeps_its_weights(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    cluster = await make_cluster(api="vllm", time_scale=SCALE)
    url, engine = cluster.urls[0], cluster.engines[0]
    engine.set_fault("update_fails")
    for path in ("/update_weights", "/update_weight_version"):
        status, answer = await post_json(session, url + path, {"weight_version": "v2"})
        assert status == 500 and "update_fails" in answer["error"]["message"], path
    assert engine.weight_version == "default"


async def test_the_fleets_ledgers_record_versions_updates_arrivals_and_token_marks(
    make_cluster: ClusterFactory, session: aiohttp.ClientSession
) -> None:
    """Engine-side truth for the replay (sim/ledger.py): each engine's versions over time and its updates, and
    per generation its arrival (before a pause let it in), its versions and its token count at each weight
    change of any engine of the fleet."""
    cluster = await make_cluster(engines=2, time_scale=SCALE, weight_update_s=1.0)
    ledgers = GenerationLedger.attach_fleet(cluster.engines)
    (url0, url1), (e0, e1) = cluster.urls, cluster.engines
    await post_json(session, url0 + "/pause_generation", {"mode": "in_place"})
    body = {"input_ids": [3], "rid": "r", "sampling_params": {"max_new_tokens": 800, "ignore_eos": True}}
    long = asyncio.create_task(post_json(session, url0 + "/generate", body))
    await asyncio.sleep(2.0 / SCALE)  # it waits behind the pause
    await post_json(session, url0 + "/continue_generation", {})
    await wait_until(lambda: (r := e0.request("r")) is not None and r.completion_tokens > 100)
    e0.set_fault("update_fails")
    failed, updated = await asyncio.gather(
        post_json(session, url0 + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}),
        post_json(session, url1 + "/update_weights_from_disk", {"model_path": "/w", "weight_version": "v2"}),
    )
    assert failed[0] == 400 and updated[0] == 200
    status, answer = await long
    assert status == 200 and answer["meta_info"]["weight_version"] == "default"
    e1.set_fault("restart", down_s=1.0, duration_s=1.0)
    (record,), _ = ledgers[0].snapshot([])
    assert record.arrived_at is not None and record.submitted_at - record.arrived_at >= 2.0
    assert record.weight_spans == (("default", 0),)
    (changed_at, tokens_then), *rest = record.token_marks  # engine 1 took v2 while it decoded on default
    assert not rest and 100 < tokens_then < 800
    w0, w1 = ledgers[0].weights(), ledgers[1].weights()
    assert [(v["version"], v["cause"]) for v in w0["versions"]] == [("default", "launch")]
    assert [(u["target"], u["ok"]) for u in w0["updates"]] == [("v2", False)]
    assert [(v["version"], v["cause"]) for v in w1["versions"]] == [
        ("default", "launch"),
        ("v2", "update"),
        ("default", "restart"),
    ]
    assert w1["versions"][1]["at"] == changed_at and [(u["target"], u["ok"]) for u in w1["updates"]] == [
        ("v2", True)
    ]
