"""A prompt given as token ids is kept as its compact JSON (server/front.py `compact_body`): the exchange
holds an `orjson.Fragment`, the engine gets the client's ids as the same JSON, and a continued stream still
prompts with them (server/continuation.py)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import orjson
import pytest

from rolloutgate.engines.base import Route
from rolloutgate.engines.upstream import UpstreamPool
from rolloutgate.server.continuation import compact_json, continuation_body, token_ids_of
from rolloutgate.server.front import compact_body
from tests.server.conftest import MakeCluster, MakeGateway


def random_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        (Route.GENERATE, "input_ids", random_ids(1000)),
        (Route.GENERATE, "input_ids", [random_ids(5, 1), random_ids(7, 2)]),  # a batch
        (Route.COMPLETIONS, "prompt", random_ids(1000)),
    ],
)
def test_token_ids_are_kept_as_their_json(route: Route, field: str, value: Any) -> None:
    body = {field: value, "sampling_params": {"max_new_tokens": 4}, "stream": False}
    before = orjson.dumps(body)
    compact_body(route, body)
    assert isinstance(body[field], orjson.Fragment)
    assert orjson.dumps(body) == before  # what an adapter sends: the same bytes
    assert token_ids_of(body[field]) == value
    assert body["sampling_params"] == {"max_new_tokens": 4}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (Route.GENERATE, {"text": "hello"}),
        (Route.GENERATE, {"text": ["a", "b"]}),
        (Route.GENERATE, {"input_ids": []}),
        (Route.COMPLETIONS, {"prompt": "hello"}),
        (Route.COMPLETIONS, {"prompt": ["a", "b"]}),
        (Route.CHAT, {"messages": [{"role": "user", "content": "hi"}], "input_ids": [1, 2]}),
    ],
)
def test_other_prompts_stay_as_they_are(route: Route, body: dict[str, Any]) -> None:
    before = {**body}
    compact_body(route, body)
    assert body == before


def test_compact_json_is_the_json_at_its_size() -> None:
    ids = random_ids(10_000)
    fragment = compact_json(ids)
    assert orjson.dumps(fragment) == orjson.dumps(ids)
    assert token_ids_of(fragment) == ids
    assert token_ids_of(ids) is ids


def generate_chunk(text: str, ids: list[int]) -> bytes:
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": len(ids)}
    return orjson.dumps({"text": text, "output_ids": ids, "meta_info": meta})


def test_a_compacted_generate_prompt_is_continued_with_its_ids_and_the_output_so_far() -> None:
    ids = random_ids(500)
    body: dict[str, Any] = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0},
    }
    compact_body(Route.GENERATE, body)
    kept = orjson.dumps(body)
    history = [generate_chunk("ab", [7, 8]), generate_chunk("abc", [7, 8, 9])]
    new, stitcher = continuation_body(Route.GENERATE, body, history, 3)
    assert token_ids_of(new["input_ids"]) == [*ids, 7, 8, 9]
    assert orjson.loads(orjson.dumps(new))["input_ids"] == [*ids, 7, 8, 9]
    assert new["sampling_params"] == {"max_new_tokens": 7, "temperature": 0}
    assert stitcher is not None and stitcher.ids == [7, 8, 9] and stitcher.text == "abc"
    assert orjson.dumps(body) == kept  # the exchange's body, for later attempts, is left as it was


async def test_the_engine_gets_the_clients_ids_and_the_exchange_keeps_a_fragment(
    make_cluster: MakeCluster, make_gateway: MakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = await make_cluster(engines=1)
    gateway = await make_gateway(cluster)
    sent: list[bytes] = []
    kept: list[Any] = []
    request_bytes = UpstreamPool.request_bytes

    def capture(self: UpstreamPool, path: str, body: bytes, headers: Any) -> bytes:
        if path == "/generate":
            sent.append(body)
            kept.extend(e.body.get("input_ids") for e in gateway.context.driver.exchanges.values())
        return request_bytes(self, path, body, headers)

    monkeypatch.setattr(UpstreamPool, "request_bytes", capture)
    ids = random_ids(20_000)
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            f"{gateway.url}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
        )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["meta_info"]["completion_tokens"] == 3
    assert answer["meta_info"]["prompt_tokens"] == len(ids)
    assert len(sent) == 1
    assert orjson.dumps(ids) in sent[0]  # the same JSON text as the client's ids
    assert orjson.loads(sent[0])["input_ids"] == ids
    assert len(kept) == 1 and isinstance(kept[0], orjson.Fragment)
    assert token_ids_of(kept[0]) == ids
