"""The simulator's weight versions per token: a generation that crosses an in-place weight update answers with
one `meta_info.weight_versions` span per version (SGLang's output offsets), whose lengths add up to its
output; one that crossed none has only `weight_version`."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

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
